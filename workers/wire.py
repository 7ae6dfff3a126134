"""What crosses Ray between the sweep's driver and its actors: the worker's configuration, a trial's
spec and its result with the memory trace. Plain dataclasses with no torch, so the driver, the
tracker and the report read them without loading a model's libraries.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from workers.decoding.methods import Method, method_of
from workers.decoding.params import MethodParams
from workers.prompts import Prompt

GIB = float(1 << 30)
# What a trace measured: the CUDA caching allocator per GPU, or the whole process's resident memory.
KIND_CUDA, KIND_RSS = "cuda", "process_rss"
PEAK_KEYS = ("peak_allocated_bytes", "peak_reserved_bytes", "peak_nvml_used_bytes")

@dataclass(frozen=True)
class MemorySample:
    t_s: float  # seconds since the trace started
    device: int  # index as torch sees it (within CUDA_VISIBLE_DEVICES)
    allocated_bytes: int
    reserved_bytes: int
    nvml_used_bytes: int | None = None  # device-wide, includes other processes and the context


@dataclass(frozen=True)
class MemoryTrace:
    samples: tuple[MemorySample, ...] = ()
    devices: tuple[int, ...] = ()
    interval_ms: float = 50.0  # effective interval: doubles each time the samples are decimated
    peak_allocated_bytes: dict[int, int] = field(default_factory=dict)
    peak_reserved_bytes: dict[int, int] = field(default_factory=dict)
    peak_nvml_used_bytes: dict[int, int] = field(default_factory=dict)
    note: str = ""
    kind: str = KIND_CUDA  # KIND_RSS: allocated_bytes and reserved_bytes both carry the process's RSS

    @property
    def peak_gib(self) -> float:
        """`peak_memory_gib` metric: max over devices of peak reserved memory."""
        return max(self.peak_gib_per_device().values(), default=0.0)

    def peak_gib_per_device(self) -> dict[int, float]:
        return {d: b / GIB for d, b in self.peak_reserved_bytes.items()}

    def to_rows(self) -> list[dict[str, Any]]:
        return [asdict(s) for s in self.samples]

    def to_dict(self) -> dict[str, Any]:
        # Peak keys become strings here so that a JSON round trip gives back exactly this dict.
        data: dict[str, Any] = {"samples": self.to_rows(), "devices": list(self.devices)}
        data.update(interval_ms=self.interval_ms, note=self.note, kind=self.kind)
        for key in PEAK_KEYS:
            data[key] = {str(d): int(v) for d, v in getattr(self, key).items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryTrace:
        return cls(
            samples=tuple(MemorySample(**s) for s in data.get("samples", [])),
            devices=tuple(int(d) for d in data.get("devices", [])),
            interval_ms=float(data.get("interval_ms", 50.0)),
            note=str(data.get("note", "")),
            kind=str(data.get("kind", KIND_CUDA)),
            **{k: {int(d): int(v) for d, v in data.get(k, {}).items()} for k in PEAK_KEYS},
        )



class TrialStatus(str, Enum):
    OK = "ok"
    OOM = "oom"  # out of memory: a result (infeasible), not a failure
    ERROR = "error"
    PRUNED = "pruned"  # stopped early by the sweep's pruner (``on_prompt`` raised TrialStopped)


@dataclass(frozen=True)
class WorkerConfig:
    target: str
    drafter: str | None = None  # required for dflash / ddtree
    dtype: str = "bfloat16"
    device: str = "auto"
    gpus: int = 1
    max_memory_per_gpu: str | None = None
    attn_implementation: str = "sdpa"
    local_files_only: bool = False  # the target and its tokenizer from this machine only (no network)
    drafter_local_files_only: bool = False  # the drafter likewise
    memory_interval_ms: float = 50.0
    chat_template: bool = True  # False: raw prompt text (no chat template)
    enable_thinking: bool = False  # only for targets whose template has the switch
    cuda_graphs: bool = True  # replay verify passes as CUDA graphs (a whole target on one GPU); False to debug
    compile_layers: bool = False  # torch.compile the decoder layers too (faster forwards; compiles per pass width)
    world_size: int = 1  # ranks the target is sharded over (one process and device each; see load(tp))


@dataclass(frozen=True)
class TrialSpec:
    params: MethodParams  # the method's parameter object (TreeParams, DFlashParams, ARParams)
    prompts: tuple[Prompt, ...]
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] | None = None  # None: the target's eos tokens
    # per-stage shares: synchronises the device around every stage, so it slows what it measures;
    # the AR baseline is then timed the same way
    stage_timing: bool = False
    warmup: bool = True
    baseline: bool = True  # also measure (once, cached) AR on the same prompts: speedup, lossless_match
    repeats: int = 1  # each prompt generated this many times; the run with its median decode time counts
    # fault injection for tests: "oom" | "error" | "crash" (kills the process) | "oom_on_last_rank" (the
    # last rank of a tensor-parallel group runs out of memory mid-pass, the others waiting for it)
    fault: str | None = None

    @property
    def method(self) -> Method:
        return method_of(self.params)


@dataclass(frozen=True)
class PromptResult:
    token_ids: list[int]
    acceptance_lengths: list[int]


@dataclass(frozen=True)
class TrialResult:
    status: TrialStatus
    method: Method
    params: dict[str, int | None]  # knob name -> value
    metrics: dict[str, float | None] = field(default_factory=dict)
    acceptance_histogram: dict[int, int] = field(default_factory=dict)
    outputs: list[PromptResult] = field(default_factory=list)
    memory_trace: MemoryTrace = field(default_factory=MemoryTrace)
    error: str | None = None
    wall_s: float = 0.0
    warnings: list[str] = field(default_factory=list)  # what the user must see (the lossless audit's mismatch)
    # the worker cannot run another trial (a rank failed and its tensor-parallel group was aborted): the
    # driver replaces it
    restart_worker: bool = False

    def to_json(self) -> dict[str, Any]:
        """The one JSON shape of a result: the bench's ``--json`` output and MLflow's result.json."""
        trace = self.memory_trace
        return {
            "method": self.method.value,
            "params": self.params,
            "status": self.status.value,
            "error": self.error,
            "wall_s": self.wall_s,
            "warnings": self.warnings,
            "metrics": self.metrics,
            "acceptance_histogram": {str(k): v for k, v in self.acceptance_histogram.items()},
            "memory": {
                "kind": trace.kind,  # "cuda": reserved bytes per GPU; "process_rss": the process's peak RSS as device 0
                "peak_reserved_bytes": {str(k): v for k, v in trace.peak_reserved_bytes.items()},
                "note": trace.note,
            },
            "outputs": [asdict(o) for o in self.outputs],
        }
