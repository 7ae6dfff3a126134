"""The target's state for one sequence, in buffers at fixed addresses (captured graphs read them).

Per attention layer a K/V buffer, per Gated DeltaNet layer the conv window [K-1, C] and recurrent
state [H, dk, dv], all updated in place; a tensor-parallel rank's hold its own heads. A verify pass
writes its K/V after the committed past and leaves each GDN node's conv input, decay and beta
(``PendingLayer``, in ``pending``) for the commit. Beside them the passes' inputs: a verify pass's
ids, depths, parents and visibility, the committed length, a commit's path (with static copies on
every other device holding layers) and ``advance``'s ids, copied in before a graph replays.
``ensure`` sizes the buffers for a run and keeps them while later runs fit.
"""

from __future__ import annotations

import torch

from workers.models.gdn import PendingLayer
from workers.seam import attention_head_dim


class KVBuffers:
    """A duck-typed transformers cache for the attention layers: static [1, kv_heads, capacity, D] buffers.

    The buffers of all attention layers on one device are views into one tensor
    [layers, 2 (K, V), 1, kv_heads, capacity, D], so a commit moves every layer's accepted rows with
    one gather and one scatter. ``update`` writes the pass's K/V at ``slots`` (device indices after
    the committed past) and returns the first ``attend`` slots, which the attention module reads
    under the pass's mask.
    """

    def __init__(self, layer_devices: dict[int, torch.device], shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.stacks: list[torch.Tensor] = []  # one per device, slots on dim 4
        self.pairs: dict[int, torch.Tensor] = {}  # layer id -> its [2, 1, kv_heads, capacity, D]
        for device in dict.fromkeys(layer_devices.values()):
            ids = [i for i, d in layer_devices.items() if d == device]
            stack = torch.zeros((len(ids), 2, *shape), dtype=dtype, device=device)
            self.stacks.append(stack)
            for j, i in enumerate(ids):
                self.keys[i], self.values[i], self.pairs[i] = stack[j, 0], stack[j, 1], stack[j]
        self.per_device = None  # the pass's shared inputs (``loop.PerDevice``): its "slots" are where K/V go
        self.attend = 0

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        slots = self.per_device.get(keys.device)["slots"]
        self.keys[layer_idx].index_copy_(2, slots, keys)
        self.values[layer_idx].index_copy_(2, slots, values)
        return self.keys[layer_idx][:, :, : self.attend], self.values[layer_idx][:, :, : self.attend]

    def move_on(self, device: torch.device, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy the K/V of slots ``source`` to slots ``destination`` (both on ``device``) in every
        attention layer on ``device``."""
        for stack in self.stacks:
            if stack.device == device:
                stack.index_copy_(4, destination, stack.index_select(4, source))


class State:
    """The buffers for the layers of ``loop`` (a ``runner.loop.Loop``) and the sequence's counters."""

    def __init__(self, loop, prefill_chunk: int) -> None:
        self.loop = loop
        self.prefill_chunk = prefill_chunk
        self.length = 0  # tokens committed
        self.capacity = 0  # K/V slots allocated (0: nothing yet)
        self.pending: dict[int, PendingLayer] = {}  # GDN layer id -> the last verify pass's per-node data
        self.state_bytes = 0  # extra bytes the last verify pass held for the tree (see PendingLayer)
        self.peak_state_bytes = 0

    def ensure(self, capacity: int, max_verify: int) -> bool:
        """Buffers for ``capacity`` committed tokens and verify passes of up to ``max_verify`` nodes:
        kept when they fit, else made anew at new addresses (then True: graphs reading the old ones are stale).

        Made as normal tensors even under inference mode, so a later caller outside it (training the
        tiny drafter on the target's taps) may still update them in place.
        """
        if capacity + max_verify <= self.capacity and max_verify <= self._max_verify_allocated():
            return False
        with torch.inference_mode(False):
            self._allocate(capacity, max_verify)
        return True

    def reset(self) -> None:
        """Zero state for a new sequence: nothing committed, GDN windows and states zero."""
        self.length, self.peak_state_bytes, self.state_bytes = 0, 0, 0
        for i in self.loop.gdn_ids:
            self.states[i].zero_()
            self.conv_windows[i].zero_()
        self.pending = {}

    def _max_verify_allocated(self) -> int:
        return self.ids.shape[0] if self.capacity else 0

    def _allocate(self, capacity: int, max_verify: int) -> None:
        loop, device = self.loop, self.loop.device
        cfg = loop.config
        # a verify pass writes its K/V after at most ``capacity`` committed tokens; rounding up keeps
        # later, slightly longer prompts from reallocating (and re-capturing every graph)
        capacity = -(-(capacity + max_verify) // 1024) * 1024
        self.capacity = capacity
        head_dim = attention_head_dim(cfg)
        kv_heads = cfg.num_key_value_heads  # this process's K/V heads: all, or one rank's share
        if loop.attention_ids:
            kv_heads = loop.layers[loop.attention_ids[0]].self_attn.k_proj.out_features // head_dim
        self.kv = KVBuffers({i: loop.layer_devices[i] for i in loop.attention_ids},
                            (1, kv_heads, capacity, head_dim), loop.dtype)
        self.conv_windows: dict[int, torch.Tensor] = {}
        self.states: dict[int, torch.Tensor] = {}
        for i in loop.gdn_ids:
            self.conv_windows[i], self.states[i] = loop.gdn[i].new_state(loop.dtype, loop.layer_devices[i])
        # the verify pass's inputs: sliced to q nodes in eager mode, read whole by a graph of width q
        self.ids = torch.zeros(max_verify, dtype=torch.long, device=device)
        self.depths = torch.zeros(max_verify, dtype=torch.long, device=device)
        self.parents = torch.zeros(max_verify, dtype=torch.long, device=device)
        self.visible = torch.zeros(max_verify, max_verify, dtype=torch.bool, device=device)
        self.kept = torch.zeros(max(max_verify, self.prefill_chunk), dtype=torch.long, device=device)
        self.committed = torch.zeros((), dtype=torch.long, device=device)  # ``length`` on the device
        self.columns = torch.arange(capacity, device=device)
        # the commit's inputs per device holding layers: the buffers themselves on the target's device,
        # static copies elsewhere (a commit graph on one device cannot read another's memory)
        self.commit_inputs: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for layer_device in dict.fromkeys(loop.layer_devices):
            if layer_device == device:
                self.commit_inputs[layer_device] = (self.kept, self.committed, self.columns)
            else:
                self.commit_inputs[layer_device] = (self.kept.to(layer_device), self.committed.to(layer_device),
                                                    self.columns.to(layer_device))
        # ``advance``'s passes (a full prompt chunk, AR's one token), captured once per width (graphs only)
        self.advance_ids = torch.zeros(self.prefill_chunk, dtype=torch.long, device=device)
        self.advance_depths = torch.arange(self.prefill_chunk, device=device)
        self._holds_chain: int | None = None  # width of the chain whose shape the input buffers hold

    # -- the inputs of a replay --------------------------------------------------------------------
    def load_verify(self, ids, depths, parents, visible, chain: bool) -> None:
        """Copy a verify pass's inputs (and the committed length) into the buffers its graph reads."""
        q = ids.shape[0]
        self.ids[:q].copy_(ids)
        # every small copy before a replay is a launch the idle GPU waits for: a chain's shape is
        # copied only when the buffers do not already hold the chain of this width
        if not (chain and self._holds_chain == q):
            self.depths[:q].copy_(depths)
            self.parents[:q].copy_(parents)
            self.visible[:q, :q].copy_(visible)
            self._holds_chain = q if chain else None
        self.committed.fill_(self.length)

    def load_advance(self, tokens: torch.Tensor) -> None:
        """Copy ``advance``'s tokens (and the committed length) into the buffers its graph reads."""
        self.advance_ids[: tokens.shape[0]].copy_(tokens)
        self.committed.fill_(self.length)

    def load_commit(self, kept: torch.Tensor) -> None:
        """Copy a commit's path (and the committed length) into the commit inputs."""
        self.kept[: kept.shape[0]].copy_(kept)
        self.committed.fill_(self.length)

    def hand_commit_inputs(self, device: torch.device, count: int) -> None:
        """Copy the path and the committed length to ``device``'s static commit inputs (no-op on the
        target's own device, whose inputs are the buffers themselves)."""
        kept, length, _ = self.commit_inputs[device]
        if kept is not self.kept:
            kept[:count].copy_(self.kept[:count])
            length.copy_(self.committed)
