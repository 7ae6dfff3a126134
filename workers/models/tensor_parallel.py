"""SHIM: a stand-in for the tensor-parallel model side (the real one shards the target by heads).

Only the contract the orchestrator relies on: ``join_group`` makes a real torch.distributed process
group (gloo on CPU, NCCL on CUDA) with a timeout on every collective, ``TPGroup`` carries the rank's
collectives, and ``shard_model`` is a no-op here (every rank keeps the whole model, so outputs match).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world: int
    group: object | None = None

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_flag(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank."""
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.broadcast(value, src=0, group=self.group)
        return bool(value.item())


def join_group(rank: int, world: int, init_method: str, backend: str | None = None,
               timeout_s: float = 300.0) -> TPGroup:
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return TPGroup(rank, world, dist.group.WORLD)


def shard_model(model, tp: TPGroup) -> None:
    """SHIM: no sharding; every rank keeps the whole model."""
