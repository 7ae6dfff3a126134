"""The tree and chunked forms of the gated delta rule and the tree conv against transformers' own sequential code.

For every node of a random tree, transformers' recurrent kernel and causal conv run along that
node's path alone (root ... node, from the committed state); the tree pass must give the same output,
and the commit (the path replayed in chunked form) the same state and conv window as the sequential run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.kernel_inputs import random_tree_parents
from workers.models.gdn import (
    MAX_PATH,
    TreeShape,
    ancestor_table,
    chain_conv,
    chain_delta_rule,
    conv_lag_index,
    tree_conv,
    tree_delta_rule,
    window_after,
)
from workers.models.tree_blocks import preorder, root_apart, tree_blocks

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


def random_inputs(q: int, generator: torch.Generator, hk: int = 2, h: int = 4, dk: int = 8, dv: int = 6):
    query, key = torch.randn(q, hk, dk, generator=generator), torch.randn(q, hk, dk, generator=generator)
    value = torch.randn(q, h, dv, generator=generator)
    log_gate = -torch.rand(q, h, generator=generator) * 2
    beta = torch.rand(q, h, generator=generator)
    state = torch.randn(h, dk, dv, generator=generator) * 0.3
    return query, key, value, log_gate, beta, state


def sequential(query, key, value, log_gate, beta, state, path):
    """transformers' recurrent kernel along ``path``: (outputs [p, H, dv], final state [H, dk, dv])."""
    out, final = qwen3_5.torch_recurrent_gated_delta_rule(
        query[path][None], key[path][None], value[path][None], log_gate[path][None], beta[path][None],
        initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    return out[0], final[0]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("chain", [False, True])
def test_tree_delta_rule_matches_sequential_per_path(seed: int, chain: bool) -> None:
    """Trees of 1..65 nodes and depth up to MAX_PATH - 1 (the deepest a tree pass takes), and chains of up to 16."""
    g = torch.Generator().manual_seed(seed)
    q = min(1 + 3 * seed + 4, MAX_PATH) if chain else (1, 5, 12, 33, 65, 40, 9, 64)[seed]
    depth = (1, 2, 4, 7, 15, 15, 3, 6)[seed]
    parents = random_parents(q, g, chain) if chain else random_tree_parents(q, depth, g)
    inputs = random_inputs(q, g)
    out = tree_delta_rule(*inputs, ancestor_table(parents))
    for node in range(q):
        path = path_of(parents, node)
        ref_out, ref_state = sequential(*inputs, path)
        torch.testing.assert_close(out[node], ref_out[-1], atol=1e-5, rtol=1e-5)
        # the commit's replay: the path as a chain in chunked form, from the committed state
        query, key, value, log_gate, beta, state = inputs
        _, committed = chain_delta_rule(query[path], key[path], value[path], log_gate[path], beta[path], state,
                                        with_outputs=False, chunk=4)
        torch.testing.assert_close(committed, ref_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length, chunk", [(1, 64), (7, 64), (13, 4), (64, 16), (100, 32), (129, 64)])
def test_chunked_chain_matches_the_recurrent_kernel(length: int, chunk: int) -> None:
    """Outputs of every token and the state after the last, over chunk boundaries and a padded last chunk."""
    g = torch.Generator().manual_seed(length)
    inputs = random_inputs(length, g, hk=2, h=6, dk=16, dv=8)
    out, state = chain_delta_rule(*inputs, chunk=chunk)
    ref_out, ref_state = sequential(*inputs, list(range(length)))
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)


def test_chunked_chain_of_a_prompt_equals_the_tree_form_per_token_and_its_commit() -> None:
    """Prefill (chunked, state kept whole) against the tree pass over the same chain: same outputs, and the
    chunked final state equals the tree pass's commit replay of the whole chain."""
    g = torch.Generator().manual_seed(3)
    inputs = random_inputs(MAX_PATH, g)
    parents = torch.arange(-1, MAX_PATH - 1)
    tree_out = tree_delta_rule(*inputs, ancestor_table(parents))
    chunk_out, chunk_state = chain_delta_rule(*inputs, chunk=5)
    _, replay_state = chain_delta_rule(*inputs, with_outputs=False, chunk=MAX_PATH)
    torch.testing.assert_close(chunk_out, tree_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunk_state, replay_state, atol=1e-5, rtol=1e-5)


def test_ancestor_table_refuses_a_tree_deeper_than_its_width() -> None:
    parents = torch.arange(-1, MAX_PATH)  # a chain of MAX_PATH + 1 nodes: depth MAX_PATH
    with pytest.raises(ValueError, match="deeper"):
        ancestor_table(parents)
    table = ancestor_table(parents[:MAX_PATH])
    assert table[-1].tolist() == list(range(MAX_PATH - 1, -1, -1))


def depth_first(parents: torch.Tensor) -> list[int]:
    """Preorder by an explicit stack, children in index order (roots too)."""
    children: dict[int, list[int]] = {t: [] for t in range(-1, parents.shape[0])}
    for t, parent in enumerate(parents.tolist()):
        children[parent].append(t)
    order, stack = [], children[-1][::-1]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(children[node][::-1])
    return order


@pytest.mark.parametrize("q, depth, seed", [(1, 1, 0), (16, 15, 1), (17, 1, 2), (40, 15, 3), (300, 6, 4),
                                            (300, 15, 5), (1025, 15, 6)])
def test_tree_blocks_hold_every_path_of_their_nodes(q: int, depth: int, seed: int) -> None:
    """The CUDA tree kernel's blocks: the preorder is the stack walk's (the root's own program aside, where
    the rest fill whole blocks); each block's slots hold every ancestor of each of its nodes, once; the
    mask is the ancestor-or-self relation of the slots."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.arange(-1, q - 1) if depth == q - 1 else random_tree_parents(q, depth, g)
    ancestors = ancestor_table(parents)
    assert preorder(ancestors).tolist() == depth_first(parents)
    slots, mask = tree_blocks(ancestors, block=16)
    apart = root_apart(q, 16)  # the root left out where the other nodes fill whole blocks
    assert apart == (q in (17, 1025))
    assert slots.shape == (-(-(q - apart) // 16), MAX_PATH + 16)
    assert mask.shape == (slots.shape[0], *slots.shape[1:] * 2)
    members = slots[:, MAX_PATH:].flatten()
    assert members[members < q].tolist() == depth_first(parents)[apart:]
    for block, block_mask in zip(slots.tolist(), mask):
        real = [s for s in block if s < q]
        assert len(real) == len(set(real))
        for node in block[MAX_PATH:]:
            if node < q:
                assert set(path_of(parents, node)) <= set(real)
        want = torch.tensor([[a < q and b < q and b in path_of(parents, a) for b in block] for a in block])
        assert torch.equal(block_mask, want)


def test_only_a_pass_that_does_not_commit_gets_tree_blocks() -> None:
    """A verify pass's shape carries the tree kernel's blocks once it is on a CUDA device
    (``with_blocks``, or the Triton launches when ``build`` runs there, as ``to`` does for a CPU-built
    shape: ``test_gdn_triton.py``); a committing pass's (AR's token, a prompt
    chunk) never does, so a graph-replayed AR step builds no blocks, and a copy mirrors its source
    tensor for tensor (what a split graph's hand-off copies into)."""
    parents = random_parents(40, torch.Generator().manual_seed(3))
    verify = TreeShape.build(parents, 3, chain=False)
    assert verify.block_slots is None  # on the CPU the torch path reads no blocks
    verify.with_blocks()
    want_slots, want_mask = tree_blocks(ancestor_table(parents))
    assert torch.equal(verify.block_slots, want_slots) and torch.equal(verify.block_mask, want_mask)
    committing = TreeShape.build(torch.arange(-1, 1), 3, chain=True, commits=True).with_blocks()
    assert committing.ancestors is not None and committing.block_slots is None
    for shape in (verify, committing):
        copy = shape.to(torch.device("cpu"))
        assert [name for name, v in vars(copy).items() if isinstance(v, torch.Tensor)] == \
            [name for name, v in vars(shape).items() if isinstance(v, torch.Tensor)]


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


def test_chain_conv_equals_the_tree_conv_of_a_chain() -> None:
    g = torch.Generator().manual_seed(11)
    inputs, committed, weight = (torch.randn(9, 5, generator=g), torch.randn(3, 5, generator=g),
                                 torch.randn(5, 4, generator=g))
    bias = torch.randn(5, generator=g)
    want, want_ext = tree_conv(inputs, committed, weight, bias, conv_lag_index(torch.arange(-1, 8), 3))
    got, got_ext = chain_conv(inputs, committed, weight, bias)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(got_ext, want_ext)


def test_a_broken_fla_install_warns_and_leaves_the_torch_form(tmp_path, monkeypatch):
    """fla-core is optional: a package named ``fla`` that fails to import (here one that raises, as a
    build against another Triton can) gives one warning and the torch chunked form, not a failed run."""
    import sys
    import warnings

    from workers.models.gdn_layer import fla_chunk_rule

    package = tmp_path / "fla" / "ops" / "gated_delta_rule"
    package.mkdir(parents=True)
    for folder in (tmp_path / "fla", tmp_path / "fla" / "ops"):
        (folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("raise RuntimeError('built for another triton')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    fla_chunk_rule.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert fla_chunk_rule() is None
            assert fla_chunk_rule() is None  # decided once per process
        assert len(caught) == 1 and "built for another triton" in str(caught[0].message)
    finally:
        fla_chunk_rule.cache_clear()
        for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
            del sys.modules[name]
