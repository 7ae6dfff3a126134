"""Random inputs of the shapes the hybrid targets' kernels see, shared by their GPU tests and benchmarks
(``tests/workers/models/test_gdn_triton.py``, ``test_attention_triton.py``, ``benchmarks/*_kernels.py``)."""

from __future__ import annotations

import torch


def random_tree_parents(q: int, depth: int, generator: torch.Generator) -> torch.Tensor:
    """[q] parents of a random tree no deeper than ``depth`` (node 0 the root, -1)."""
    parents, depths = [-1], [0]
    for t in range(1, q):
        choices = [j for j in range(t) if depths[j] < depth]
        parent = choices[int(torch.randint(0, len(choices), (1,), generator=generator))]
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return torch.tensor(parents)


def deep_tree_parents(q: int, generator: torch.Generator) -> torch.Tensor:
    """[q >= 17] parents of a tree with a 16-node chain (nodes 0..15, the deepest path a pass handles) and
    q - 16 random nodes hung under node 3, no deeper than 15. Random trees seldom pass depth 6, where a
    solve's L^8 term first weighs."""
    branch = random_tree_parents(q - 16, 11, generator)
    return torch.cat((torch.arange(-1, 15), torch.where(branch < 0, 3, branch + 16)))


def attention_pass_inputs(heads: int, groups: int, q: int, capacity: int, length: int, dim: int, dtype,
                          seed: int, device: str = "cuda", causal: bool = False, ends: bool = False):
    """A verify pass's folded attention after ``length`` committed tokens: (query [Hkv, g*q, D], key,
    value [Hkv, C, D] with NaN after the pass's keys, the runner's additive mask [g*q, C] (the past
    visible, the pass's own keys by a random visibility, or every earlier one: ``causal``, a prompt
    chunk), the pass's K/V slots [q]), and with ``ends`` each node's ``visible_ends`` [q]."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(heads, groups * q, dim, generator=g).to(dtype).to(device)
    key, value = (torch.randn(heads, capacity, dim, generator=g).to(dtype).to(device) for _ in range(2))
    key[:, length + q :], value[:, length + q :] = float("nan"), float("nan")
    visible = (torch.rand(q, q, generator=g) < (1.0 if causal else 0.3)).tril() | torch.eye(q, dtype=torch.bool)
    columns = torch.arange(capacity)
    relative = columns - length
    block = visible[:, relative.clamp(0, q - 1)] & (relative >= 0) & (relative < q)
    allowed = (columns < length) | block
    mask = torch.full((q, capacity), torch.finfo(dtype).min, dtype=dtype).masked_fill_(allowed, 0.0)
    slots = length + torch.arange(q)
    inputs = (query, key, value, mask.repeat(groups, 1).to(device), slots.to(device))
    if not ends:
        return inputs
    from workers.models.fused_layer import visible_ends

    return *inputs, visible_ends(visible, slots).to(device)
