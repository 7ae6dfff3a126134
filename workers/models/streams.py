"""Independent pieces of GPU work queued on side streams, so they may run at once.

``branches``: inside ``with branches(device, n) as on:``, each ``with on(k):`` queues its work on side
stream k % n. Every side stream first waits for what the current stream had queued (the fork) and the
current stream waits for all of them at the end (the join), so the block as a whole is ordered like
one launch. Under CUDA graph capture the fork and join are captured too: the pieces become parallel
branches of the graph, which the GPU may run side by side. What it is for: the commit's GDN layers
(``runner.loop.Loop.commit_on``), each one kernel of a few programs per value head that walks the
accepted path step by step, short on work and long on latency, and independent of each other. One
stream runs them one after another; several fill the GPU. With ``n`` <= 1 or off CUDA, ``on(k)``
queues on the current stream, exactly as without this module.

``beside``: ``with beside(marked):`` queues its work on a side stream that waits for ``marked`` (an
event recorded earlier on the current stream), not for what that stream queued since, and the current
stream waits for it at exit. What it is for: a round's commit, which needs the round's walk but not the next draft
that the engine queued after the walk (``workers.decoding.generation.ReadLater.beside``), so the two run
side by side. ``marked`` None queues in line.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


def gpu_index(device: torch.device) -> int:
    """A CUDA device's index ("cuda" alone: the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _side_streams(device_index: int, count: int) -> tuple[torch.cuda.Stream, ...]:
    """``count`` streams on the GPU, made once per process (a captured graph records its kernels, not
    the streams, so one set serves every capture and eager call). From torch's high-priority pool: the
    default pool, taken round-robin, also gives ``torch.cuda.graph`` its capture stream, and a branch
    on the very stream it forks from would run in line."""
    return tuple(torch.cuda.Stream(device=device_index, priority=-1) for _ in range(count))


@contextlib.contextmanager
def branches(device: torch.device, count: int) -> Iterator[Callable[[int], contextlib.AbstractContextManager]]:
    """Yields ``on``: ``with on(k):`` queues its work on side stream k % ``count`` of ``device``,
    forked from the current stream at entry and joined back into it at exit. Work inside must not hand
    memory it allocates to work outside (the caching allocator ties a block to the stream it was made on)."""
    if device.type != "cuda" or count <= 1:
        yield lambda k: contextlib.nullcontext()
        return
    index = gpu_index(device)
    main = torch.cuda.current_stream(index)
    streams = _side_streams(index, count)
    for stream in streams:
        stream.wait_stream(main)
    try:
        yield lambda k: torch.cuda.stream(streams[k % count])
    finally:
        for stream in streams:
            main.wait_stream(stream)


@dataclass(frozen=True)
class Mark:
    """A point in a GPU's current stream (an event recorded there): the work queued before it."""

    event: torch.cuda.Event
    device_index: int


@contextlib.contextmanager
def beside(marked: Mark | None) -> Iterator[None]:
    """Inside: work queued on a side stream of the marked GPU, after ``marked`` only; at exit the current
    stream waits for it, so what it queues next comes after. ``marked`` None: in line. The same
    caution on memory as ``branches``."""
    if marked is None:
        yield
        return
    main = torch.cuda.current_stream(marked.device_index)
    side = _side_streams(marked.device_index, 1)[0]
    side.wait_event(marked.event)
    try:
        with torch.cuda.stream(side):
            yield
    finally:
        main.wait_stream(side)
