"""Batch-1 attention over grouped K/V heads, without copying K/V once per query head.

With grouped-query attention (e.g. 32 query heads over 8 K/V heads) and an explicit mask,
transformers' SDPA path repeats K and V for every query head (``repeat_kv``): a copy of the whole
K/V per layer and per tensor, every pass. At batch 1 the query heads
of a group can instead be folded into the query length: [1, Hq, q, D] -> [Hkv, g*q, D], one
attention over the original K/V, with the mask repeated per folded row (``attend_folded``: batched
products for few rows, SDPA for many).

``NO_CUDNN`` leaves out cuDNN's SDPA: it builds a new execution plan for every new K/V length, which
the drafter, whose context grows every round, would pay every round. The
target reads fixed-size K/V buffers on CUDA, where cuDNN's cached plans are the fastest choice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from workers.models.kernels import triton_available

NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# above this many folded query rows (query heads per K/V head x queries) one fused SDPA kernel wins
SMALL_ATTENTION_ROWS = 512


def grouped_attention(
    query: torch.Tensor,  # [1, Hq, q, D]
    key: torch.Tensor,  # [1, Hkv, C, D]
    value: torch.Tensor,  # [1, Hkv, C, D]
    mask: torch.Tensor | None = None,  # additive [1, 1, q, C]; None = every key visible
    scale: float | None = None,
    backends: list[SDPBackend] | None = None,  # for the fused SDPA kernel; None: torch's own choice
) -> torch.Tensor:
    """Softmax attention -> [1, Hq, q, D]; query head h reads K/V head h // (Hq / Hkv)."""
    _, query_heads, length, dim = query.shape
    groups = query_heads // key.shape[1]
    folded = query.reshape(key.shape[1], groups * length, dim)  # row r*q + t = head (kv*g + r), token t
    if mask is not None:
        mask = mask.reshape(-1, mask.shape[-1]).expand(length, -1).repeat(groups, 1)
    scale = dim**-0.5 if scale is None else scale
    out = attend_folded(folded, key[0], value[0], mask, scale, backends)
    return out.reshape(1, query_heads, length, dim)


def attend_folded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                  scale: float, backends: list[SDPBackend] | None = None,
                  slots: torch.Tensor | None = None, nodes: int | None = None,
                  ends: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of folded rows: query [Hkv, R, D] over key/value [Hkv, C, D] with an
    additive mask [R, C] (None: all visible) -> [Hkv, R, D]; given ``nodes`` (R = g x nodes, row
    i * nodes + t: query head i of the group, node t) -> [nodes, Hq * D], as o_proj reads it.

    Given the pass's K/V ``slots`` (every key after the last of them masked, every key before the
    first visible) and half-precision inputs on CUDA: ``attention_triton.attend_until``, which reads
    keys only up to that slot (with ``ends`` [nodes], one past the last slot nodes 0..t see: each
    block of rows only up to its last node's). Otherwise, few rows:
    scores by one batched product and softmax (accumulated in float32, as transformers' eager
    attention), three small kernels, cheaper than a fused SDPA kernel for a handful of rows
    (``benchmarks/attention_kernels.py``). Many rows: SDPA.
    """
    # with the slots, the kernel whatever the rows (a decode step's too): it reads the keys up to the
    # pass's last slot where the batched products read the whole buffer (``benchmarks/attention_kernels.py``,
    # whose "no kernel" lines are those products; results in ``benchmarks/results/wide_passes_h200.md``)
    if slots is not None and mask is not None and query.is_cuda and triton_available():
        from workers.models import attention_triton

        if attention_triton.supports(query, key):
            out = attention_triton.attend_until(query, key, value, mask, slots, scale, nodes=nodes, ends=ends)
            if out is not None:  # None: the GPU lacks the shared memory for its tiles
                return out
    if query.shape[1] > SMALL_ATTENTION_ROWS:
        with sdpa_kernel(backends) if backends else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(query[None], key[None], value[None], attn_mask=mask, scale=scale)[0]
    else:
        if mask is None:
            scores = torch.bmm(query, key.transpose(1, 2)).mul_(scale)
        else:
            scores = torch.baddbmm(mask, query, key.transpose(1, 2), alpha=scale)  # [Hkv, R, C]
        out = torch.bmm(torch.softmax(scores, dim=-1), value)  # (half-precision softmax accumulates in float32)
    if nodes is None:
        return out
    return out.reshape(-1, nodes, out.shape[-1]).transpose(0, 1).reshape(nodes, -1)  # [Hq, nodes, D] -> [nodes, Hq*D]


def _transformers_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The call shape of transformers' attention functions; returns ([1, q, Hq, D], no weights)."""
    return grouped_attention(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def grouped_attention_in(config) -> Iterator[None]:
    """Route this model's SDPA / eager attention through ``grouped_attention`` while inside.

    transformers looks the attention function up by ``config._attn_implementation`` at every call;
    a local override of that entry lasts only for our own forwards (other code sees the original).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(config, "_attn_implementation", None)
    if name not in ("sdpa", "eager"):  # flash-attention & co. handle grouped heads themselves
        yield
        return
    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    previous = local.get(name)
    local[name] = _transformers_attention
    try:
        yield
    finally:
        if previous is None:
            local.pop(name, None)
        else:
            local[name] = previous
