"""What every decoding engine shares: its settings, its result, the output buffer and stage timers.

The engines (``workers.decoding.ar``, ``workers.decoding.dflash``, ``workers.decoding.ddtree``) have one call shape::

    generate(target, drafter, prompt_ids, config, params, timer=NULL_TIMER) -> GenerationOutput

and all count the same way: a round commits the tokens it accepted plus one token the target chose
itself (the bonus); ``acceptance_lengths`` holds that count per round, bonus included (AR: all 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from workers.decoding.sampling import make_generator, sample_tokens
from workers.models.streams import Mark, beside, gpu_index

# Each round's commit queued beside the next draft (``workers.models.streams.beside``), not after it: the
# two are independent, and the commit is short of work (``benchmarks/commit_branches.py`` times it both ways;
# the H200's figures are in docs/gpu.md).
COMMIT_BESIDE_DRAFT = True


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int
    temperature: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass(frozen=True)
class GenerationOutput:
    token_ids: list[int]  # generated ids only, stop token included when one ended the output
    acceptance_lengths: list[int]  # tokens committed per round, bonus included
    stage_times: dict[str, float]  # seconds per stage (empty unless a StageTimer was passed)
    ttft_s: float  # prompt prefill through the first generated token
    decode_s: float  # everything after that

    @property
    def num_rounds(self) -> int:
        return len(self.acceptance_lengths)


class OutputBuffer:
    """Collects committed tokens and decides when generation ends (stop token or token limit)."""

    def __init__(self, config: GenerationConfig) -> None:
        self.tokens: list[int] = []
        self.max_new_tokens = config.max_new_tokens
        self.stop = frozenset(config.stop_token_ids)
        self.done = False

    def extend(self, new_tokens: list[int]) -> None:
        for token in new_tokens:
            self.tokens.append(token)
            if token in self.stop or len(self.tokens) >= self.max_new_tokens:
                self.done = True
                return


class StageTimer:
    """Wall time per named stage. On CUDA it synchronises around each stage so the time is the
    stage's own; pass it only when stage shares are wanted (benchmarks), never by default."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync or (lambda: None)
        self.totals: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.sync()
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - begin


class _NullTimer:
    """The default: records nothing and adds no synchronisation."""

    @property
    def totals(self) -> dict[str, float]:
        return {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        yield


NULL_TIMER = _NullTimer()


def device_sync(device: torch.device) -> Callable[[], None]:
    """The synchronise call that makes host timings honest on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class ReadLater:
    """A small device tensor's copy to the host, started without waiting for the work queued after it.
    ``read()`` waits for the copy alone and gives the host tensor (on the CPU, the tensor). An engine
    queues its next draft between the two, so the GPU is busy while the host reads; and
    ``with read.beside(target_device):`` queues the round's commit after the copied tensor's work only,
    beside that draft (``COMMIT_BESIDE_DRAFT``; else in line)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device = tensor.device
        self.copied: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":
            self.host = tensor
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record(torch.cuda.current_stream(tensor.device))

    def __call__(self) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host

    def beside(self, target_device: torch.device) -> AbstractContextManager[None]:
        """Work queued inside waits for what was queued before the copy, not for what came after it,
        where ``COMMIT_BESIDE_DRAFT`` and the tensor is on the target's own GPU (the commit's first
        work); in line otherwise."""
        marked = None
        if COMMIT_BESIDE_DRAFT and self.copied is not None and target_device.type == "cuda":
            if gpu_index(target_device) == gpu_index(self.device):
                marked = Mark(self.copied, gpu_index(self.device))
        return beside(marked)


class Clock:
    """TTFT / decode split for one generation, synchronising only at the two boundaries."""

    def __init__(self, device: torch.device) -> None:
        self._sync = device_sync(device)
        self._sync()
        self._begin = time.perf_counter()
        self._first = self._begin

    def first_token(self) -> None:
        self._sync()
        self._first = time.perf_counter()

    def finish(self, ended_at: float | None = None) -> tuple[float, float]:
        """(TTFT, decode) seconds; ``ended_at``: when the last token reached the host (work queued
        after it is not the output's), else now, once the device is done."""
        if ended_at is None:
            self._sync()
        end = time.perf_counter() if ended_at is None else ended_at
        return self._first - self._begin, end - self._first


@dataclass
class Opening:
    """Where every engine stands after the prompt: the first token is out, the round loop starts."""

    clock: Clock
    out: OutputBuffer
    generator: torch.Generator
    bonus: torch.Tensor  # [1] the target's token after the committed text, not yet in its cache
    context: torch.Tensor  # [1, T, k*H] taps of the prompt (empty without taps)
    capacity: int  # token slots the caches were sized for


def open_generation(target, prompt_ids: torch.Tensor, config: GenerationConfig, max_verify: int) -> Opening:
    """Fresh target cache sized for the run, prompt prefill, and the first generated token.

    ``max_verify`` is the most tokens one round sends to the target (root included).
    """
    clock = Clock(target.device)
    capacity = prompt_ids.shape[1] + config.max_new_tokens + max_verify
    target.start(capacity=capacity, max_verify=max_verify)
    prefill = target.prefill(prompt_ids)
    generator = make_generator(config.seed, prefill.logits.device)
    bonus = sample_tokens(prefill.logits[-1:], config.temperature, generator)  # [1]
    out = OutputBuffer(config)
    out.extend([int(bonus.item())])  # sync: the first token must reach the host for stop checks
    clock.first_token()
    return Opening(clock, out, generator, bonus, prefill.taps, capacity)
