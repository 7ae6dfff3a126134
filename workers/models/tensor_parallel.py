"""Tensor parallelism for batch-1 decoding: N processes, each holding 1/N of every layer.

At batch 1 a forward pass reads every weight once, so its time is the weight bytes over the memory
bandwidth. Split every layer over N GPUs and each reads 1/N at once. The split here suits that:

- attention by K/V-head groups: rank r holds K/V heads [r*Hkv/N, (r+1)*Hkv/N) and their query heads
  (rows of q_proj, which for gated attention carry each head's output gate beside its query), and
  the matching input columns of o_proj;
- GDN by heads: rank r holds key heads [r*Hk/N, ...) and their value heads, so each
  head's conv channels, recurrent state and tree data live on that rank only; out_proj by columns;
- MLP column- then row-parallel (gate/up rows, down_proj columns); MoE experts likewise by their
  intermediate dim, the shared expert too; router and shared_expert_gate replicated;
- norms, rotary and the embedding replicated; lm_head by vocabulary rows, the logits gathered so
  every rank holds (bitwise) the same full logits and samples and accepts the same tokens.

Every block then ends in a row-parallel projection whose outputs are partial sums: one all-reduce
after each (two per decoder layer), applied by the runner (``StaticTarget``) through ``TPGroup``
before the residual is added. Each shard is a copy of a slice of the model's own weights.

Lockstep: every decision an engine takes (acceptance, the tree, stopping) reads the target's or the
drafter's logits, which come out of the gathered lm_head: each rank's columns computed by that rank
alone, so the gathered tensor is bitwise the same everywhere. The taps are hidden states after an
all-reduce, also bitwise the same. The (replicated) drafter therefore drafts the same tree on every rank.

    tp = join_group(rank, world_size, "tcp://127.0.0.1:29500")   # in each of the N processes
    shard_model(model, tp)                                  # in place
    target = make_target(model, taps, tp=tp)
"""

from __future__ import annotations

import datetime
import json
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.errors import BadInputError
from workers.seam import text_config

ALARM_KEY = "alarm/first-failure"  # in the group's store: the first failure, as JSON


def _wake_key(rank: int) -> str:
    return f"alarm/wake/{rank}"  # set for every rank by a failure, for one rank by its own close()


class GroupAlarm:
    """How a rank that fails tells the others at once, before they wait for it in a collective.

    A rank that raises mid-trial (an OOM on its GPU) leaves the others in a collective it will never
    enter; NCCL's watchdog would end that only after the group's timeout, and collectives captured in
    a CUDA graph it does not watch at all. So the failing rank writes its failure under one key of the
    group's store (the first one written wins), wakes every rank's watcher thread, and aborts its
    process group; each watcher aborts its rank's group. An aborted group ends what waits in it (NCCL
    aborts its communicators, whose kernels poll for that; gloo's peers see their connections close),
    so every rank's call returns within moments with the first failure; the group is then gone and the
    worker must be made anew (``TrialResult.restart_worker``).
    """

    def __init__(self, store: dist.TCPStore, host: str, port: int, rank: int, world_size: int,
                 timeout_s: float) -> None:
        self.rank, self.world_size = rank, world_size
        self._group_store = store  # kept: on rank 0 it serves the store, which must outlive an aborted group
        self.first_failure: dict | None = None  # {"rank", "status", "error"} once any rank raised the alarm
        self._closing = False
        timeout = datetime.timedelta(seconds=timeout_s)
        # two connections of our own: the watcher blocks on one; the group's store is the group's
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        self._watched = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        self._watcher = threading.Thread(target=self._watch, name="tp-group-alarm", daemon=True)
        self._watcher.start()

    @property
    def raised(self) -> bool:
        return self.first_failure is not None

    def raise_alarm(self, status: str, error: str) -> dict:
        """This rank failed with (status, error): tell every rank (unless one already has) and abort
        this rank's group. Returns the group's first failure, which may be another rank's."""
        mine = json.dumps({"rank": self.rank, "status": status, "error": error})
        try:
            first = json.loads(self._store.compare_set(ALARM_KEY, "", mine))
            for rank in range(self.world_size):
                self._store.set(_wake_key(rank), "alarm")
        except Exception:  # the store's host (rank 0) is gone: this rank's failure is all it knows
            first = json.loads(mine)
        self._abort(first)
        return first

    def close(self) -> None:
        """Stop this rank's watcher (before the process ends: a thread blocked in the store when the
        interpreter exits and the store's host goes away aborts the process)."""
        self._closing = True
        try:
            self._store.set(_wake_key(self.rank), "closed")
        except Exception:  # the store is gone, and with it the watcher's wait
            pass
        self._watcher.join(timeout=5.0)

    def _watch(self) -> None:
        try:
            while True:
                try:
                    self._watched.wait([_wake_key(self.rank)], datetime.timedelta(hours=1))
                    break
                except dist.DistStoreError:  # waited an hour: keep waiting
                    continue
            if not self._closing:
                self._abort(json.loads(self._watched.get(ALARM_KEY)))
        except Exception:  # the store went away with rank 0: the group is over (RankGroup's watch ends it)
            return

    def _abort(self, first: dict) -> None:
        if self.first_failure is None:
            self.first_failure = first
        if not dist.is_initialized():
            return
        try:
            dist.distributed_c10d._abort_process_group()  # every group of this process, collectives in flight
        except Exception:  # an older torch, or aborted meanwhile by the other thread
            if dist.is_initialized():
                dist.destroy_process_group()


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group and the group's collectives."""

    rank: int
    world_size: int
    group: object | None = None  # a torch.distributed ProcessGroup; None = the default group
    alarm: GroupAlarm | None = field(default=None, compare=False)  # a failing rank tells the others

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it (the same values on every rank)."""
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along the last dim, in rank order."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_flag(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank: a decision taken on one rank, made by all in lockstep."""
        device = torch.device("cuda", torch.cuda.current_device()) if self._backend() == "nccl" else "cpu"
        value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        dist.broadcast(value, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        return bool(value.item())  # a host sync, once per prompt

    def _backend(self) -> str:
        return str(dist.get_backend(self.group))

    def close(self) -> None:
        """Leave the group: the alarm's watcher stopped, the process group destroyed (if not aborted)."""
        if self.alarm is not None:
            self.alarm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def join_group(rank: int, world_size: int, init_method: str, backend: str | None = None,
               timeout_s: float = 300.0) -> TPGroup:
    """Join the default process group (gloo on CPU, nccl when CUDA is available unless ``backend``).

    ``init_method`` is ``tcp://host:port``: rank 0 serves the group's store there. ``timeout_s`` bounds
    every collective: a rank that died makes the others fail instead of hang; one that raises tells
    them at once (``GroupAlarm``).
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    address = urlsplit(init_method)
    if address.scheme != "tcp" or address.hostname is None or address.port is None:
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address.hostname, address.port, world_size, is_master=rank == 0, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore("group", store), rank=rank, world_size=world_size,
                            timeout=timeout)
    alarm = GroupAlarm(store, address.hostname, address.port, rank, world_size, timeout_s)
    return TPGroup(rank, world_size, alarm=alarm)


# -- sharding ------------------------------------------------------------------------------------------
def shard_model(model: nn.Module, tp: TPGroup) -> None:
    """Keep this rank's slice of every layer of ``model`` (in place); see the module docstring.

    Raises BadInputError, before changing anything, when a head count or size does not divide by N.
    """
    cfg = text_config(model.config)
    check_divisible(cfg, tp.world_size)
    if tp.world_size == 1:
        return
    base = getattr(model, "model", model)
    with torch.no_grad():
        for layer in base.layers:
            if hasattr(layer, "self_attn"):
                _shard_attention(layer.self_attn, cfg, tp)
            if hasattr(layer, "linear_attn"):
                _shard_gdn(layer.linear_attn, tp)
            _shard_mlp(layer.mlp, tp)
        model.set_output_embeddings(VocabParallelHead(model.get_output_embeddings(), tp))


def check_divisible(cfg, world_size: int) -> None:
    """BadInputError naming the first head count (or MLP size) that ``world_size`` ranks cannot split."""
    counts = {"num_key_value_heads": cfg.num_key_value_heads, "num_attention_heads": cfg.num_attention_heads}
    if "linear_attention" in (getattr(cfg, "layer_types", None) or ()):
        counts |= {"linear_num_key_heads": cfg.linear_num_key_heads,
                   "linear_num_value_heads": cfg.linear_num_value_heads}
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(cfg, name, None):
            counts[name] = getattr(cfg, name)
    for name, count in counts.items():
        if count % world_size:
            raise BadInputError(f"tensor_parallel={world_size}: the target's {name}={count} does not divide by "
                                f"{world_size}; use a tensor-parallel size that divides it")


def _part(tensor: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous 1/world_size of ``tensor`` along ``dim``, as a tensor of its own."""
    size = tensor.shape[dim] // world_size
    return tensor.narrow(dim, rank * size, size).clone()


def _parts(tensor: torch.Tensor, sizes: list[int], dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Split ``tensor`` along ``dim`` into consecutive blocks of ``sizes``; keep this rank's 1/world_size of each."""
    return torch.cat([_part(block, dim, rank, world_size) for block in torch.split(tensor, sizes, dim=dim)], dim=dim)


def _set(module: nn.Module, name: str, value: torch.Tensor | None) -> None:
    if value is not None:
        setattr(module, name, nn.Parameter(value, requires_grad=False))


def _rows(linear: nn.Linear, tp: TPGroup, sizes: list[int] | None = None) -> None:
    """Column-parallel: keep this rank's output rows (per block of ``sizes`` when given)."""
    cut = ((lambda t: _part(t, 0, tp.rank, tp.world_size)) if sizes is None
           else (lambda t: _parts(t, sizes, 0, tp.rank, tp.world_size)))
    _set(linear, "weight", cut(linear.weight))
    _set(linear, "bias", None if linear.bias is None else cut(linear.bias))
    linear.out_features = linear.weight.shape[0]


def _columns(linear: nn.Linear, tp: TPGroup) -> None:
    """Row-parallel: keep this rank's input columns; a bias is added once (rank 0) to the summed output."""
    _set(linear, "weight", _part(linear.weight, 1, tp.rank, tp.world_size))
    if linear.bias is not None and tp.rank != 0:
        _set(linear, "bias", torch.zeros_like(linear.bias))
    linear.in_features = linear.weight.shape[1]


def _shard_attention(attn: nn.Module, cfg, tp: TPGroup) -> None:
    """q_proj rows by query heads (each head's rows, its gate included), k/v_proj rows by K/V heads,
    o_proj columns by query heads. q/k norms act per head_dim: replicated."""
    _rows(attn.q_proj, tp)
    _rows(attn.k_proj, tp)
    _rows(attn.v_proj, tp)
    _columns(attn.o_proj, tp)
    for name, total in (("num_heads", cfg.num_attention_heads), ("num_attention_heads", cfg.num_attention_heads),
                        ("num_key_value_heads", cfg.num_key_value_heads)):
        if hasattr(attn, name):
            setattr(attn, name, total // tp.world_size)


def _shard_gdn(mixer: nn.Module, tp: TPGroup) -> None:
    """GDN by key heads and their value heads (``v head h`` reads key head ``h // (Hv/Hk)``).

    Conv channels are [q (Hk*dk), k (Hk*dk), v (Hv*dv)]: each part cut by heads. Qwen3.5 projects
    with in_proj_qkv (the same three parts), in_proj_z (by value head) and in_proj_b / in_proj_a (one
    row per value head). Qwen3-Next's in_proj_qkvz / in_proj_ba are blocks per key head
    ([q, k, v-group, z-group] and [b-group, a-group]; transformers' ``fix_query_key_value_ordering``),
    so a contiguous run of key-head blocks is a contiguous run of rows.
    """
    key_dim, value_dim = mixer.key_dim, mixer.value_dim
    channel_parts = [key_dim, key_dim, value_dim]
    if hasattr(mixer, "in_proj_qkvz"):
        _rows(mixer.in_proj_qkvz, tp)
        _rows(mixer.in_proj_ba, tp)
    else:
        _rows(mixer.in_proj_qkv, tp, channel_parts)
        _rows(mixer.in_proj_z, tp)
        _rows(mixer.in_proj_b, tp)
        _rows(mixer.in_proj_a, tp)
    conv = mixer.conv1d  # depthwise: weight [C, 1, K], one group per channel
    _set(conv, "weight", _parts(conv.weight, channel_parts, 0, tp.rank, tp.world_size))
    _set(conv, "bias", None if conv.bias is None else _parts(conv.bias, channel_parts, 0, tp.rank, tp.world_size))
    conv.in_channels = conv.out_channels = conv.groups = conv.weight.shape[0]
    _set(mixer, "A_log", _part(mixer.A_log, 0, tp.rank, tp.world_size))
    _set(mixer, "dt_bias", _part(mixer.dt_bias, 0, tp.rank, tp.world_size))
    _columns(mixer.out_proj, tp)
    mixer.num_k_heads //= tp.world_size
    mixer.num_v_heads //= tp.world_size
    mixer.key_dim, mixer.value_dim = key_dim // tp.world_size, value_dim // tp.world_size
    mixer.conv_dim = conv.weight.shape[0]


def _shard_mlp(mlp: nn.Module, tp: TPGroup) -> None:
    """Dense: gate/up rows, down_proj columns. MoE: every expert and the shared expert by their
    intermediate dim; the router and shared_expert_gate read the whole hidden state: replicated."""
    if hasattr(mlp, "experts"):
        experts = mlp.experts  # gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I]
        inner = experts.gate_up_proj.shape[1] // 2
        _set(experts, "gate_up_proj", _parts(experts.gate_up_proj, [inner, inner], 1, tp.rank, tp.world_size))
        _set(experts, "down_proj", _part(experts.down_proj, 2, tp.rank, tp.world_size))
        if hasattr(experts, "intermediate_dim"):
            experts.intermediate_dim = inner // tp.world_size
        if getattr(mlp, "shared_expert", None) is not None:
            _shard_mlp(mlp.shared_expert, tp)
        return
    _rows(mlp.gate_proj, tp)
    _rows(mlp.up_proj, tp)
    _columns(mlp.down_proj, tp)
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = mlp.gate_proj.out_features


class VocabParallelHead(nn.Module):
    """lm_head by vocabulary rows; returns the full logits (gathered), the same on every rank.

    The vocabulary is padded to a multiple of N with zero rows (rank r holds rows [r*c, (r+1)*c) of
    the padded matrix), and the padding columns are cut from the gathered logits. The drafter calls
    the target's lm_head too, so it gets full logits through the same module.
    """

    def __init__(self, head: nn.Linear, tp: TPGroup) -> None:
        super().__init__()
        if head.bias is not None:
            raise BadInputError("tensor parallelism: an lm_head with a bias is not supported")
        self.tp = tp
        self.vocab_size = self.out_features = head.weight.shape[0]  # the logits' width, as nn.Linear's
        rows = -(-self.vocab_size // tp.world_size)  # per rank, padding included
        begin, end = tp.rank * rows, min((tp.rank + 1) * rows, self.vocab_size)
        local = torch.zeros(rows, head.weight.shape[1], dtype=head.weight.dtype, device=head.weight.device)
        local[: max(end - begin, 0)] = head.weight.detach()[begin:end]
        self.weight = nn.Parameter(local, requires_grad=False)  # [c, H]
        self.rows = (begin, end)  # this rank's real vocabulary rows

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] (every rank's columns, in rank order)."""
        return self.tp.all_gather_last(F.linear(hidden, self.weight))[..., : self.vocab_size]
