"""The tree form of the gated delta rule and the tree conv against transformers' own sequential code.

For every node of a random tree, transformers' recurrent kernel and causal conv run along that
node's path alone (root ... node, from the committed state); the tree pass must give the same output,
and the commit must give the same state and conv window as the sequential run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.models.deltanet import (
    conv_lag_index,
    state_after,
    tree_conv,
    tree_delta_rule,
    window_after,
)

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def random_parents(q: int, generator: torch.Generator, chain: bool = False) -> torch.Tensor:
    """Topologically ordered random tree: node 0 is the root, every parent precedes its child."""
    parents = [-1]
    for t in range(1, q):
        parents.append(t - 1 if chain else int(torch.randint(0, t, (1,), generator=generator)))
    return torch.tensor(parents)


def path_of(parents: torch.Tensor, node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def visibility(parents: torch.Tensor) -> torch.Tensor:
    q = parents.shape[0]
    visible = torch.zeros(q, q, dtype=torch.bool)
    for t in range(q):
        visible[t, path_of(parents, t)] = True
    return visible


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("chain", [False, True])
def test_tree_delta_rule_matches_sequential_per_path(seed: int, chain: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    q, hk, h, dk, dv = 1 + 3 * seed + 4, 2, 4, 8, 6
    parents = random_parents(q, g, chain)
    query, key = torch.randn(q, hk, dk, generator=g), torch.randn(q, hk, dk, generator=g)
    value = torch.randn(q, h, dv, generator=g)
    log_gate = -torch.rand(q, h, generator=g) * 2
    beta = torch.rand(q, h, generator=g)
    state = torch.randn(h, dk, dv, generator=g) * 0.3

    out, keys, deltas, G = tree_delta_rule(query, key, value, log_gate, beta, state, visibility(parents), head_group=3)
    for node in range(q):
        path = path_of(parents, node)
        ref_out, ref_state = qwen3_5.torch_recurrent_gated_delta_rule(
            query[path][None], key[path][None], value[path][None], log_gate[path][None], beta[path][None],
            initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(out[node], ref_out[0, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state_after(state, keys, deltas, G, torch.tensor(path)), ref_state[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_tree_conv_matches_causal_conv_per_path(seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    q, channels, kernel = 2 + 4 * seed, 5, 4
    window = kernel - 1
    parents = random_parents(q, g)
    inputs = torch.randn(q, channels, generator=g)
    committed = torch.randn(window, channels, generator=g)  # the last K-1 committed inputs
    weight = torch.randn(channels, kernel, generator=g)
    lags = conv_lag_index(parents, window)
    out, extended = tree_conv(inputs, committed, weight, None, lags)
    for node in range(q):
        sequence = torch.cat((committed, inputs[path_of(parents, node)]))  # [T, C] oldest first
        reference = F.silu(F.conv1d(sequence.T[None], weight[:, None], padding=0, groups=channels))[0, :, -1]
        torch.testing.assert_close(out[node], reference, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(window_after(extended, lags, torch.tensor([node])), sequence[-window:])


def test_tree_conv_from_an_empty_window_zero_pads_like_the_first_tokens() -> None:
    g = torch.Generator().manual_seed(7)
    inputs, weight = torch.randn(2, 3, generator=g), torch.randn(3, 4, generator=g)
    parents = torch.tensor([-1, 0])
    out, _ = tree_conv(inputs, torch.zeros(3, 3), weight, None, conv_lag_index(parents, 3))
    reference = F.silu(F.conv1d(inputs.T[None], weight[:, None], padding=3, groups=3))[0, :, :2].T
    torch.testing.assert_close(out, reference)
