"""The generation worker: load the models once, then run many trials.

``Worker(config).load()`` places the target (one device or split over GPUs) and the drafter next to
the target's lm_head. ``run_trial(spec)`` generates every prompt with one method and setting, under
the GPU-memory tracer, and returns a ``TrialResult`` with the metrics of DESIGN.md. The AR baseline
runs on each prompt just before the method (both warmed up), so every speedup compares runs of the
same moment on the same actor. A CUDA out-of-memory error
becomes a result with status "oom" (memory freed, worker still usable); any other exception becomes
status "error" with its message. Ray wraps this class in the orchestrator; it does not need Ray.

Tensor parallel (``world_size = N``): N workers, one per rank of a ``TPGroup``, each call
``load(tp)`` (every rank reads the checkpoint on the CPU, keeps its shard, moves only that to its
device, and loads the drafter whole) and then ``run_trial`` with the same spec. Every rank runs the same rounds in
lockstep; only rank 0 gets ``on_prompt``, and its stop decision is broadcast after each prompt.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import torch

from workers import costs as cost_model
from workers.audit import audit, audit_metrics, unexplained_warning
from workers.decoding import replay
from workers.decoding.generation import (
    NULL_TIMER,
    GenerationConfig,
    GenerationOutput,
    StageTimer,
    device_sync,
)
from workers.decoding.methods import METHODS, Method
from workers.decoding.params import ARParams, MethodParams
from workers.errors import BadInputError, TrialStopped
from workers.memory import MemoryTracer, reset_and_empty_cache
from workers.metrics import acceptance_histogram, median_run, per_category, summarize
from workers.models.drafter import DFlashDrafter
from workers.models.drafter_config import DrafterSpec
from workers.models.facts import load_tokenizer
from workers.models.loading import Placement, load_drafter, load_target, parse_dtype, resolve_checkpoint_dir
from workers.models.placement import drafter_bytes_for
from workers.models.runner.target import make_target
from workers.models.sources import ModelSource
from workers.models.tensor_parallel import TPGroup, shard_model
from workers.prompts import ChatFormat, encode, stop_token_ids
from workers.wire import KIND_CUDA, PromptResult, TrialResult, TrialSpec, TrialStatus, WorkerConfig

WARMUP_TOKENS = 16


class Worker:
    """One target + drafter kept resident; ``run_trial`` many times."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.model = None
        self.drafter: DFlashDrafter | None = None
        self.target = None  # a StaticTarget (workers.models.runner.target.make_target)
        self.tokenizer = None
        self._state_bytes: int | None = None  # peak tree_state_bytes of the last _generate_all (hybrids)
        self.tp: TPGroup | None = None  # this worker's rank in a tensor-parallel group (None: alone)

    def load(self, tp: TPGroup | None = None) -> Worker:
        """Load target and drafter. ``tp``: this process's rank of a tensor-parallel group of
        ``config.world_size`` ranks; this rank's shard of the target goes onto this process's
        device (its GPU as cuda:0, or the CPU), see ``_load_shard``."""
        cfg = self.config
        world_size = 1 if tp is None else tp.world_size
        if world_size != cfg.world_size:
            raise BadInputError(f"tensor_parallel={cfg.world_size} but this worker was given a group of {world_size} "
                                f"rank(s); start one worker per rank and pass each its TPGroup")
        self.tp = tp if world_size > 1 else None
        if self.tp is not None:
            self.model = self._load_shard(self.tp)
        else:
            placement = Placement(device=cfg.device, gpus=cfg.gpus, max_memory_per_gpu=cfg.max_memory_per_gpu,
                                  drafter_bytes=self._drafter_bytes())
            self.model = load_target(cfg.target, cfg.dtype, placement, cfg.attn_implementation, cfg.local_files_only)
        self.tokenizer = load_tokenizer(cfg.target, cfg.local_files_only)
        taps: tuple[int, ...] = ()
        if cfg.drafter is not None:
            self.drafter = load_drafter(cfg.drafter, self.model, local_files_only=cfg.drafter_local_files_only)
            taps = self.drafter.spec.target_layer_ids
        tap_device = self.drafter.fc.weight.device if self.drafter else None
        self.target = make_target(self.model, taps, tap_device, graphs=None if cfg.cuda_graphs else False,
                                  compile_layers=cfg.compile_layers, tp=self.tp)
        return self

    def _load_shard(self, tp: TPGroup):
        """This rank's shard of the target on this process's device. A checkpoint is read onto the CPU
        (safetensors are memory-mapped, so the ranks share the page cache), cut, and only the shard
        moves to the GPU: the whole model need not fit on one GPU. On CUDA the per-rank memory plan is
        checked first (refused with the numbers). A random:<shape> target is built on the device."""
        cfg = self.config
        device = Placement(device=cfg.device).resolve_device()
        random_target = ModelSource.parse(cfg.target).is_random
        if device.type == "cuda" and not random_target:
            from transformers import AutoConfig

            from workers.models.placement import plan_tensor_parallel

            config = AutoConfig.from_pretrained(cfg.target, local_files_only=cfg.local_files_only)
            plan_tensor_parallel(config, torch.cuda.get_device_properties(device).total_memory, tp.world_size,
                                 parse_dtype(cfg.dtype), self._drafter_bytes(tensor_parallel=True))
        staging = Placement(device=str(device) if random_target else "cpu")
        model = load_target(cfg.target, cfg.dtype, staging, cfg.attn_implementation, cfg.local_files_only)
        shard_model(model, tp)
        return model.to(device)

    def _drafter_bytes(self, tensor_parallel: bool = False) -> int:
        """The drafter's weight bytes, reserved beside lm_head when the target is split or (every rank)
        tensor-parallel; else 0."""
        cfg = self.config
        if (cfg.gpus <= 1 and not tensor_parallel) or cfg.drafter is None or ModelSource.parse(cfg.drafter).is_random:
            return 0
        folder = resolve_checkpoint_dir(cfg.drafter, cfg.drafter_local_files_only)
        spec = DrafterSpec.from_config_file(folder / "config.json")
        return drafter_bytes_for(spec, parse_dtype(cfg.dtype))

    @property
    def block_size(self) -> int | None:
        return self.drafter.block_size if self.drafter else None

    def run_trial(self, spec: TrialSpec, on_prompt=None) -> TrialResult:
        """``on_prompt(outputs, baseline)`` (optional) runs after each prompt with the outputs so far;
        raising ``TrialStopped`` there ends the trial with status "pruned" (early stopping).

        Tensor parallel: every rank calls this with the same spec; rank 0 passes ``on_prompt``, the
        others None, and all stop together (rank 0's decision is broadcast after each prompt)."""
        started = time.perf_counter()
        tracer = MemoryTracer(interval_ms=self.config.memory_interval_ms)
        status, error, outputs, metrics, baseline, warnings = TrialStatus.OK, None, [], {}, None, []
        injected = self._inject_rank_oom() if spec.fault == "oom_on_last_rank" else None
        try:
            with tracer:
                if spec.fault == "oom":
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by TrialSpec.fault)")
                if spec.fault == "error":
                    raise RuntimeError("injected failure (TrialSpec.fault)")
                if spec.fault == "crash":  # the process dies as on a CUDA illegal-address abort
                    os._exit(17)
                prompts, gen = self._prepare(spec)
                outputs, baseline = self._generate_all(spec, prompts, gen, on_prompt, lockstep=True)
                state_bytes = self._state_bytes
            greedy = gen.temperature < 1e-5
            metrics = summarize(outputs, baseline, greedy=greedy)
            metrics |= per_category(spec.prompts, outputs, baseline)
            if greedy and baseline is not None:  # why an output left AR's, where one did
                divergences = audit(self.target, prompts, [o.token_ids for o in outputs],
                                    [b.token_ids for b in baseline], self.model.get_input_embeddings().weight.dtype)
                metrics |= audit_metrics(divergences)
                warnings += [w for w in (unexplained_warning(divergences),) if w]
            if state_bytes is not None:  # hybrid targets: per-node GDN data held per round
                metrics["tree_state_bytes"] = float(state_bytes)
        except torch.cuda.OutOfMemoryError as exc:
            status, error = TrialStatus.OOM, f"{type(exc).__name__}: {exc}"
        except TrialStopped as exc:
            status, error = TrialStatus.PRUNED, str(exc)
        except (BadInputError, ValueError) as exc:
            status, error = TrialStatus.ERROR, str(exc)
        except Exception as exc:  # a trial must end in a result, never take the worker down
            status, error = TrialStatus.ERROR, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
        if injected is not None:
            injected.remove()
        restart = False
        if self.tp is not None and (status in (TrialStatus.OOM, TrialStatus.ERROR) or self.tp.alarm.raised):
            # a rank that failed tells the others, whose collectives it may have left waiting: every rank
            # ends with the group's first failure, and the group is gone (the driver makes a new worker)
            first = self.tp.alarm.raise_alarm(status.value, error or "")
            if first["rank"] != self.tp.rank:
                error = f"tensor-parallel rank {first['rank']}: {first['error']}"
            status, restart = TrialStatus(first["status"]), True
        if status is TrialStatus.OOM:
            reset_and_empty_cache()  # outside the except block: the traceback no longer pins tensors
        trace = tracer.trace
        metrics["peak_memory_gib"] = trace.peak_gib  # CUDA reserved, or the process's RSS on CPU (trace.kind)
        if trace.kind == KIND_CUDA:
            for device, gib in trace.peak_gib_per_device().items():
                metrics[f"peak_memory_gib_dev{device}"] = gib
        return TrialResult(
            status=status,
            method=spec.method,
            params=spec.params.as_dict(),
            metrics=metrics,
            acceptance_histogram=acceptance_histogram(outputs),
            outputs=[PromptResult(o.token_ids, o.acceptance_lengths) for o in outputs],
            memory_trace=trace,
            error=error,
            wall_s=time.perf_counter() - started,
            warnings=warnings,
            restart_worker=restart,
        )

    def _inject_rank_oom(self):
        """Fault injection: this trial's third lm_head call on the group's last rank (the only rank
        alone) runs out of memory, mid-pass, while the other ranks wait for it in the logits' gather.
        Returns the hook's handle (to remove)."""
        if self.tp is not None and self.tp.rank != self.tp.world_size - 1:
            return None
        calls = []

        def out_of_memory(module, inputs) -> None:
            calls.append(1)
            if len(calls) == 3:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected on the last rank, mid-pass)")

        return self.model.get_output_embeddings().register_forward_pre_hook(out_of_memory)

    # -- internals ---------------------------------------------------------------------------------
    def _prepare(self, spec: TrialSpec) -> tuple[list[torch.Tensor], GenerationConfig]:
        if self.target is None:
            raise RuntimeError("Worker.load() must run before run_trial()")
        if METHODS[spec.method].needs_drafter and self.drafter is None:
            raise BadInputError(f"method '{spec.method.value}' needs a drafter, and this worker has none")
        rows = self.model.get_input_embeddings().weight.shape[0]
        chat = ChatFormat(self.config.chat_template, self.config.enable_thinking)
        prompts = [torch.tensor([encode(p, self.tokenizer, rows, chat)], dtype=torch.long) for p in spec.prompts]
        stops = spec.stop_token_ids
        if stops is None:
            stops = stop_token_ids(self.tokenizer, self.model.generation_config or self.model.config)
        gen = GenerationConfig(spec.max_new_tokens, spec.temperature, tuple(stops), spec.seed)
        return prompts, gen

    def _generate_all(self, spec: TrialSpec, prompts: list[torch.Tensor], gen: GenerationConfig, on_prompt=None,
                      lockstep: bool = False) -> tuple[list[GenerationOutput], list[GenerationOutput] | None]:
        """Every prompt of the trial: (the method's outputs, the AR baseline's or None).

        With ``spec.baseline`` each prompt runs AR just before the method, both warmed up first: the
        speedup then compares runs of the same moment on the same actor (a baseline measured once, on a
        cold actor, read AR slow and every speedup too high: ``benchmarks/results/gpu_sweep_27b_h200.md``).
        ``lockstep``: the trial's own run, where (tensor parallel) every rank takes rank 0's stop decision
        after each prompt.
        """
        runs = [(METHODS[spec.method], spec.params)]
        if spec.baseline:
            runs.insert(0, (METHODS[Method.AR], ARParams()))
        if spec.warmup:  # one short untimed run each, so lazy init and graph captures stay out of the numbers
            warm = GenerationConfig(min(WARMUP_TOKENS, gen.max_new_tokens), gen.temperature, (), gen.seed)
            for entry, params in runs:
                entry.generate(self.target, self.drafter if entry.needs_drafter else None, prompts[0], warm, params)
        timed: list[list[GenerationOutput]] = [[] for _ in runs]
        state_bytes = 0
        for index, prompt_ids in enumerate(prompts):
            prompt_gen = GenerationConfig(gen.max_new_tokens, gen.temperature, gen.stop_token_ids, gen.seed + index)
            for (entry, params), done in zip(runs, timed, strict=True):
                # repeats give the same tokens (same seed); only the times differ, and the median one counts
                done.append(median_run([self._measure(entry, params, prompt_ids, prompt_gen, spec.stage_timing)
                                        for _ in range(max(spec.repeats, 1))]))
                state_bytes = max(state_bytes, getattr(self.target, "peak_state_bytes", 0))
            outputs, baseline = timed[-1], (timed[0] if spec.baseline else None)
            self._after_prompt(outputs, baseline, on_prompt, lockstep)
        self._state_bytes = state_bytes if getattr(self.target, "gdn_ids", ()) else None
        return timed[-1], (timed[0] if spec.baseline else None)

    def _measure(self, entry, params, prompt_ids: torch.Tensor, config: GenerationConfig,
                 stage_timing: bool) -> GenerationOutput:
        timer = StageTimer(device_sync(self.target.device)) if stage_timing else NULL_TIMER  # one per run
        drafter = self.drafter if entry.needs_drafter else None
        return entry.generate(self.target, drafter, prompt_ids, config, params, timer=timer)

    def _after_prompt(self, outputs: list[GenerationOutput], baseline: list[GenerationOutput] | None, on_prompt,
                      lockstep: bool) -> None:
        """Run ``on_prompt``; with tensor parallelism every rank then stops iff rank 0 stopped."""
        stopped: BaseException | None = None
        if on_prompt is not None:
            try:
                on_prompt(outputs, baseline[: len(outputs)] if baseline is not None else None)
            except Exception as exc:  # TrialStopped (or a failure): the other ranks must stop too
                stopped = exc
        if self.tp is not None and lockstep and self.tp.broadcast_flag(stopped is not None) and stopped is None:
            stopped = TrialStopped("stopped early by rank 0 of the tensor-parallel group")
        if stopped is not None:
            raise stopped

    # -- sweep intelligence: acceptance replay and the cost table (workers.decoding.replay, workers.costs)
    def replay_tables(self, spec: TrialSpec, top_k: int) -> list[dict[str, Any]]:
        """One ``ReplayTable`` (as a dict) per prompt of ``spec``: the AR continuation and the drafter's
        top-``top_k`` per depth at every round start, for predicting any setting's rounds."""
        prompts, gen = self._prepare(spec)
        if self.drafter is None:
            raise BadInputError("acceptance replay needs a drafter, and this worker has none")
        tables = []
        for index, prompt_ids in enumerate(prompts):
            config = GenerationConfig(gen.max_new_tokens, gen.temperature, gen.stop_token_ids, gen.seed + index)
            tables.append(replay.record(self.target, self.drafter, prompt_ids, config, top_k).to_dict())
        return tables

    def measure_costs(self, spec: TrialSpec, settings: list[MethodParams]) -> dict[str, Any]:
        """This actor's ``CostTable`` (as a dict) for ``settings`` (parameter objects, any methods), its
        passes timed where the trials' generations start and end (the mean prompt, then max_new_tokens
        on); calibrated on the first prompt of ``spec``."""
        prompts, gen = self._prepare(spec)
        mean_prompt = sum(p.shape[1] for p in prompts) // len(prompts)
        table = cost_model.measure_costs(
            self.target, self.drafter, settings, (mean_prompt, mean_prompt + gen.max_new_tokens),
            calibration_prompt=prompts[0], calibration=gen,
        )
        return table.to_dict()
