"""Captured CUDA graphs by key, least recently used dropped beyond a limit.

Each captured graph keeps a private memory pool (its activations and outputs). A sweep visits many
tree budgets, hence many verify widths; keeping every graph would grow an actor's memory trial after
trial, so only the most recently used few are kept and a dropped one is captured again if needed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any


class GraphCache:
    def __init__(self, limit: int, on_evict: Callable[[Hashable], None] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.on_evict = on_evict
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, key: Hashable) -> Any:
        self._entries.move_to_end(key)  # most recently used last
        return self._entries[key]

    def __setitem__(self, key: Hashable, value: Any) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.limit:
            dropped, _ = self._entries.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(dropped)

    def keys(self) -> list[Hashable]:
        return list(self._entries)


def capture(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """Record ``fn`` (reading and writing only tensors at fixed addresses) as a CUDA graph.

    Two warm-up calls run first on a side stream (lazy initialisation, allocator and library
    workspaces, the products' cuBLASLt algorithms: ``lt_product.choosing``), as torch's graph capture
    requires. Returns (graph, fn's outputs as recorded); each ``graph.replay()`` recomputes those
    outputs in place.
    """
    import torch

    from workers.models import lt_product

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), lt_product.choosing():  # the products' algorithms are timed here
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs
