"""Tensor-parallel targets (``workers.models.tensor_parallel``) on CPU: real gloo groups in spawned processes.

Float32 tiny models of the three architectures (Qwen3, Qwen3.5, Qwen3-Next with MoE). One group of
2 ranks runs every setting of every method on every architecture (spawning costs seconds), plus the
Worker's lockstep stop; one group of 4 ranks does the same on tiny shapes whose heads divide by 4.
Each rank's tokens must equal the single-process run's and the greedy AR reference; the logits and
taps must be bitwise the same on every rank. In-process tests check that each shard is the slice of
the model's own weights it should be, and that a head count that does not divide is refused.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from tools.local_group import run_local_group
from tools.tiny import TinyShape, write_tiny_pair
from workers.decoding import ar, ddtree, dflash
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import DFlashParams, TreeParams
from workers.errors import BadInputError
from workers.models.loading import Placement, load_drafter, load_target
from workers.models.runner.target import make_target
from workers.models.tensor_parallel import TPGroup, shard_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW = 20
# (label, engine, params): chains and trees across budgets, depths and branchings (depths <= block 6 - 1)
SETTINGS = (
    ("ar", ar.generate, None),
    ("dflash", dflash.generate, DFlashParams()),
    ("dflash-3", dflash.generate, DFlashParams(num_draft_tokens=3)),
    ("ddtree-4", ddtree.generate, TreeParams(budget=4)),
    ("ddtree-12-d3-b2", ddtree.generate, TreeParams(budget=12, max_depth=3, branching=2)),
    ("ddtree-8-d5-b1", ddtree.generate, TreeParams(budget=8, max_depth=5, branching=1)),
    ("ddtree-32", ddtree.generate, TreeParams(budget=32)),
)
# TP=4 (4 processes on a small CI machine are slow: fewer settings, the hybrids only) on shapes whose
# head counts divide by 4 (head_dim 4 at hidden 32)
WIDE = dict(num_heads=8, num_kv_heads=4, gdn_key_heads=4, gdn_value_heads=8, vocab_size=6, block_size=6)
WIDE_SETTINGS = ("ar", "dflash-3", "ddtree-12-d3-b2")
WIDE_PROMPTS = 1


def prompts(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7 + vocab)
    return [torch.randint(1, vocab, (1, length), generator=generator) for length in (13, 5)]


def load_pair(target_dir: Path, drafter_dir: Path, tp: TPGroup | None = None):
    """(model, drafter, target) from the tiny checkpoints; sharded for ``tp``."""
    model = load_target(str(target_dir), dtype="float32", placement=Placement(device="cpu"))
    if tp is not None:
        shard_model(model, tp)
    drafter = load_drafter(str(drafter_dir), model)
    return model, drafter, make_target(model, drafter.spec.target_layer_ids, tp=tp)


def decode_all(target, drafter, vocab: int, labels: tuple[str, ...] | None = None,
               count: int = 2) -> dict[str, list[list[int]]]:
    """Greedy tokens per setting label (all, or ``labels``) and prompt (the first ``count``)."""
    config = GenerationConfig(max_new_tokens=MAX_NEW)
    return {label: [engine(target, None if params is None else drafter, p, config, params).token_ids
                    for p in prompts(vocab)[:count]]
            for label, engine, params in SETTINGS if labels is None or label in labels}


def same_on_every_rank(tp: TPGroup, tensor: torch.Tensor) -> bool:
    rows = tp.all_gather_last(tensor.reshape(1, -1)).view(tp.world_size, -1)
    return all(torch.equal(rows[0], row) for row in rows)


def _rank_decodes(tp: TPGroup, pairs: list[tuple[str, str, str, int]], worker_pair: tuple[str, str] | None,
                  labels: tuple[str, ...] | None = None, count: int = 2) -> dict:
    """One rank: every pair's decodes, whether prefill logits / taps agree bitwise, the Worker's lockstep stop."""
    torch.set_num_threads(1)
    results = {}
    for name, target_dir, drafter_dir, vocab in pairs:
        _, drafter, target = load_pair(Path(target_dir), Path(drafter_dir), tp)
        with torch.inference_mode():
            tokens = decode_all(target, drafter, vocab, labels, count)
            target.start(capacity=64, max_verify=8)
            out = target.prefill(prompts(vocab)[0])
            identical = same_on_every_rank(tp, out.logits) and same_on_every_rank(tp, out.taps)
        results[name] = {"tokens": tokens, "identical": identical}
    if worker_pair is not None:
        results["worker"] = _worker_trials(tp, *worker_pair)
    return results


def _worker_trials(tp: TPGroup, target_dir: str, drafter_dir: str) -> dict:
    """A DDTree trial, then one that rank 0 stops after its first prompt."""
    from workers.errors import TrialStopped
    from workers.prompts import Prompt
    from workers.wire import TrialSpec, WorkerConfig
    from workers.worker import Worker

    config = WorkerConfig(target=target_dir, drafter=drafter_dir, dtype="float32", device="cpu",
                          chat_template=False, world_size=tp.world_size)
    worker = Worker(config).load(tp)
    spec = TrialSpec(TreeParams(budget=8), tuple(Prompt(input_ids=tuple(p[0].tolist())) for p in prompts(6)),
                     max_new_tokens=MAX_NEW, warmup=False)

    def stop_after_first(outputs, baseline):
        raise TrialStopped("enough")

    done = worker.run_trial(spec)
    stopped = worker.run_trial(spec, on_prompt=stop_after_first if tp.rank == 0 else None)
    return {"status": done.status.value, "tokens": [o.token_ids for o in done.outputs], "error": done.error,
            "metrics": done.metrics, "stopped": stopped.status.value}


def check_group(outcomes, pairs, references: dict[str, dict[str, list[list[int]]]]) -> None:
    for outcome in outcomes:
        assert outcome.ok, f"rank {outcome.rank}: {outcome.error}"
        for name, *_ in pairs:
            got = outcome.value[name]
            assert got["identical"], f"{name}: logits or taps differ between ranks"
            expected = references[name]
            for label, tokens in got["tokens"].items():
                assert tokens == expected[label], f"{name} {label} rank {outcome.rank}"
                assert tokens == expected["ar"], f"{name} {label}: not the greedy AR output"


# -- TP=2 on the conftest models; TP=4 on wider ones ---------------------------------------------------
@pytest.mark.slow  # local process groups
def test_tp2_equals_one_process(tiny, tiny_hybrid, tiny_next):
    fixtures = {"qwen3": tiny, "qwen3_5": tiny_hybrid, "qwen3_next": tiny_next}
    pairs = [(name, str(m.target_dir), str(m.drafter_dir), m.shape.vocab_size) for name, m in fixtures.items()]
    references = {}
    with torch.inference_mode():
        for name, m in fixtures.items():
            references[name] = decode_all(m.target, m.drafter, m.shape.vocab_size)
    outcomes = run_local_group(2, _rank_decodes, (pairs, (str(tiny_hybrid.target_dir), str(tiny_hybrid.drafter_dir))),
                               timeout_s=60)
    check_group(outcomes, pairs, references)
    for outcome in outcomes:  # the Worker on every rank: same result; rank 0's stop stops all
        worker = outcome.value["worker"]
        assert worker["status"] == "ok", worker["error"]
        assert worker["tokens"] == outcomes[0].value["worker"]["tokens"]
        assert worker["metrics"]["lossless_match"] == 1.0  # against its own (tensor-parallel) AR baseline
        assert worker["stopped"] == "pruned"  # on every rank, though only rank 0 had on_prompt
        assert "peak_memory_gib" in worker["metrics"]  # every rank returns its own memory trace


@pytest.mark.slow  # local process groups
def test_tp4_equals_one_process(tmp_path):
    pairs, references = [], {}
    for arch in ("qwen3_5", "qwen3_next"):
        shape = TinyShape(arch=arch, **WIDE)
        target_dir, drafter_dir = write_tiny_pair(tmp_path / arch, shape)
        _, drafter, target = load_pair(target_dir, drafter_dir)
        with torch.inference_mode():
            references[arch] = decode_all(target, drafter, shape.vocab_size, WIDE_SETTINGS, WIDE_PROMPTS)
        pairs.append((arch, str(target_dir), str(drafter_dir), shape.vocab_size))
    outcomes = run_local_group(4, _rank_decodes, (pairs, None, WIDE_SETTINGS, WIDE_PROMPTS), timeout_s=60)
    check_group(outcomes, pairs, references)


# -- the shards are slices of the model's own weights --------------------------------------------------
def expected_shard(name: str, full: torch.Tensor, cfg, rank: int, world_size: int) -> torch.Tensor:
    """This rank's part of parameter ``name`` of the whole model, written out rule by rule."""

    def chunk(t, dim):
        size = t.shape[dim] // world_size
        return t.narrow(dim, rank * size, size)

    def chunks(t, sizes, dim):
        return torch.cat([chunk(part, dim) for part in torch.split(t, sizes, dim)], dim)

    if name == "lm_head.weight":  # vocabulary rows, padded to a multiple of world_size with zeros
        rows = -(-full.shape[0] // world_size)
        padded = torch.cat((full, full.new_zeros(rows * world_size - full.shape[0], full.shape[1])))
        return padded[rank * rows : (rank + 1) * rows]
    leaf = name.split(".")[-2] if name.endswith((".weight", ".bias")) else name.split(".")[-1]
    if "linear_attn" in name and leaf in ("in_proj_qkv", "conv1d"):  # [q, k, v] parts by heads
        key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        return chunks(full, [key_dim, key_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim], 0)
    if name.endswith("experts.gate_up_proj"):
        return chunks(full, [full.shape[1] // 2] * 2, 1)
    if name.endswith("experts.down_proj"):
        return chunk(full, 2)
    if leaf in ("o_proj", "out_proj", "down_proj"):
        return chunk(full, 1)
    if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_z", "in_proj_b", "in_proj_a",
                "in_proj_qkvz", "in_proj_ba", "A_log", "dt_bias"):
        return chunk(full, 0)
    return full  # replicated: norms, embedding, router, shared_expert_gate


@pytest.mark.parametrize("fixture", ["tiny", "tiny_hybrid", "tiny_next"])
def test_each_shard_is_a_slice_of_the_model(request, fixture):
    models = request.getfixturevalue(fixture)
    whole = dict(models.model.named_parameters())
    cfg = models.model.config
    for rank in range(2):
        model = load_target(str(models.target_dir), dtype="float32", placement=Placement(device="cpu"))
        shard_model(model, TPGroup(rank, 2))  # no collective runs while sharding
        shard = dict(model.named_parameters())
        assert shard.keys() == whole.keys()
        for name, param in shard.items():
            expected = expected_shard(name, whole[name].detach(), cfg, rank, 2)
            assert torch.equal(param, expected), f"{fixture} rank {rank}: {name}"
            assert param.data_ptr() != whole[name].data_ptr()
        attn = next(layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn"))
        assert attn.k_proj.out_features == cfg.num_key_value_heads // 2 * attn.head_dim
        if fixture != "tiny":
            mixer = model.model.layers[0].linear_attn
            heads = (cfg.linear_num_key_heads // 2, cfg.linear_num_value_heads // 2)
            assert (mixer.num_k_heads, mixer.num_v_heads) == heads


def test_a_head_count_that_does_not_divide_is_refused(tiny):
    model = load_target(str(tiny.target_dir), dtype="float32", placement=Placement(device="cpu"))
    before = model.model.layers[0].self_attn.k_proj.weight.clone()
    with pytest.raises(BadInputError, match=r"tensor_parallel=3: the target's num_key_value_heads=2 does not divide"):
        shard_model(model, TPGroup(0, 3))
    assert torch.equal(model.model.layers[0].self_attn.k_proj.weight, before)  # refused before changing anything


# -- a dead rank fails the others' collectives instead of hanging ----------------------------------------
def _die_or_reduce(tp: TPGroup) -> dict:
    if tp.rank == 1:
        os._exit(3)  # as a rank killed mid-trial
    started = time.perf_counter()
    try:
        tp.all_reduce_(torch.ones(4))
        time.sleep(0.2)
        tp.all_reduce_(torch.ones(4))
    except Exception as exc:  # what a caller sees: a collective error, within the timeout
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - started}
    return {"error": None, "seconds": time.perf_counter() - started}


@pytest.mark.slow  # local process groups
def test_a_dead_rank_fails_the_collective_within_the_timeout():
    outcomes = run_local_group(2, _die_or_reduce, timeout_s=5, wait_s=60)
    assert outcomes[1].exitcode == 3
    survivor = outcomes[0]
    assert survivor.exitcode == 0 and survivor.value is not None, survivor.error
    assert survivor.value["error"] is not None
    assert survivor.value["seconds"] < 30


# -- a rank that raises tells the others at once (GroupAlarm) -------------------------------------------
def _rank_runs_out_of_memory(tp: TPGroup, target_dir: str, drafter_dir: str, folder: str) -> dict:
    """A Worker trial whose last rank runs out of memory in its third lm_head call (mid-pass: rank 0
    then waits for it in the logits' gather), timed on every rank. Each rank then stays alive, group
    open, until every rank is done, as a Ray rank does (a process that exits would close its
    connections and so end the others' wait by itself)."""
    from workers.prompts import Prompt
    from workers.wire import TrialSpec, WorkerConfig
    from workers.worker import Worker

    config = WorkerConfig(target=target_dir, drafter=drafter_dir, dtype="float32", device="cpu",
                          chat_template=False, world_size=tp.world_size)
    worker = Worker(config).load(tp)
    spec = TrialSpec(TreeParams(budget=8), tuple(Prompt(input_ids=tuple(p[0].tolist())) for p in prompts(6)),
                     max_new_tokens=MAX_NEW, warmup=False, fault="oom_on_last_rank")
    started = time.perf_counter()
    result = worker.run_trial(spec)
    seconds = time.perf_counter() - started
    (Path(folder) / f"done{tp.rank}").touch()
    while len(list(Path(folder).glob("done*"))) < tp.world_size:
        time.sleep(0.1)
    return {"status": result.status.value, "error": result.error, "restart": result.restart_worker,
            "seconds": seconds}


@pytest.mark.slow  # a local process group
def test_a_rank_that_runs_out_of_memory_mid_pass_ends_every_ranks_trial_at_once(tiny_hybrid, tmp_path):
    timeout_s = 120.0  # the collectives' own timeout: the trial must end long before it
    pair = (str(tiny_hybrid.target_dir), str(tiny_hybrid.drafter_dir))
    outcomes = run_local_group(2, _rank_runs_out_of_memory, (*pair, str(tmp_path)), timeout_s=timeout_s, wait_s=300)
    for outcome in outcomes:
        assert outcome.ok, f"rank {outcome.rank}: {outcome.error}"
        result = outcome.value
        assert result["status"] == "oom" and result["restart"], result  # infeasible, as on one GPU
        assert result["seconds"] < timeout_s / 4, result
    assert "injected on the last rank" in outcomes[1].value["error"]
    assert outcomes[0].value["error"].startswith("tensor-parallel rank 1: ")  # rank 0 names who failed
