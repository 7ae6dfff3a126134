"""Tests for workers.decoding.tree: DDTree best-first construction and the verification walk.

Everything is checked against independent, naive implementations written here: a brute-force
enumeration of all prefixes, the paper's heap algorithm written out plainly, a naive ancestor
relation and a naive walk from the root.
"""

from __future__ import annotations

import heapq
import itertools
import random

import numpy as np
import pytest
import torch

from workers.decoding.params import TreeParams
from workers.decoding.tree import DraftTree, ancestor_matrix, build_tree, follow_tree

# --- helpers ------------------------------------------------------------------------------------------


def random_log_probs(
    rng: np.random.Generator, num_positions: int, vocab: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Random log-softmax rows [L, V] with a spread of sharp and flat distributions (no exact ties)."""
    scale = rng.uniform(0.3, 4.0, size=(num_positions, 1))
    logits = rng.normal(size=(num_positions, vocab)) * scale
    logits -= logits.max(axis=1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))  # numpy: tiny and fast
    return torch.from_numpy(log_probs).to(dtype)


def random_params(rng: np.random.Generator, num_positions: int, vocab: int) -> TreeParams:
    budget = int(rng.integers(1, 65))
    max_depth = None if rng.random() < 0.4 else int(rng.integers(1, num_positions + 3))  # may exceed L
    branching = None if rng.random() < 0.4 else int(rng.integers(1, vocab + 2))  # may exceed V
    return TreeParams(budget=budget, max_depth=max_depth, branching=branching)


def random_cases(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        num_positions = int(rng.integers(1, 7))
        vocab = int(rng.integers(2, 9))
        yield random_log_probs(rng, num_positions, vocab), random_params(rng, num_positions, vocab)


def depth_limit_of(num_positions: int, params: TreeParams) -> int:
    return num_positions if params.max_depth is None else min(params.max_depth, num_positions)


def allowed_tokens(log_probs: torch.Tensor, params: TreeParams) -> list[list[int]]:
    """Per position, the tokens a node may carry: all V, or the top-`branching` ones."""
    allowed = []
    for row in log_probs.tolist():
        order = sorted(range(len(row)), key=lambda t: -row[t])
        allowed.append(order if params.branching is None else order[: params.branching])
    return allowed


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Token sequence from the root (exclusive) to each node 1..n."""
    parents = tree.parents.tolist()
    tokens = [None] + tree.tokens.tolist()
    paths: list[tuple[int, ...]] = [()]
    for node in range(1, len(parents)):
        paths.append(paths[parents[node]] + (tokens[node],))
    return paths[1:]


def path_log_prob(log_probs: torch.Tensor | list[list[float]], path: tuple[int, ...]) -> float:
    rows = log_probs.tolist() if isinstance(log_probs, torch.Tensor) else log_probs
    return float(sum(rows[d][t] for d, t in enumerate(path)))


def naive_visibility(parents: list[int]) -> torch.Tensor:
    size = len(parents)
    vis = [[False] * size for _ in range(size)]
    for i in range(size):
        j = i
        while j >= 0:
            vis[i][j] = True
            j = parents[j]
    return torch.tensor(vis, dtype=torch.bool).reshape(size, size)


def brute_force_log_probs(log_probs: torch.Tensor, params: TreeParams) -> np.ndarray:
    """Path log-probs of every prefix of length 1..depth_limit over the allowed tokens (float64)."""
    lp = log_probs.double().numpy()
    allowed = allowed_tokens(log_probs, params)
    levels, frontier = [], np.zeros(1)
    for depth in range(depth_limit_of(lp.shape[0], params)):
        frontier = (frontier[:, None] + lp[depth, allowed[depth]][None, :]).reshape(-1)
        levels.append(frontier)
    return np.concatenate(levels)


def reference_tree(log_probs: torch.Tensor, budget: int) -> tuple[list[int], list[int], list[int]]:
    """The DDTree paper's best-first algorithm, written out plainly (default knobs).

    Heap of (-score, depth, parent's place, rank, ...); pop -> add node; push the next sibling (same
    depth, next rank) and the first child (next depth, rank 0). Depth limit = L, top-K = min(B, V).
    Exact score ties go to the shallower prefix, then to the child of the parent popped earlier
    among its depth, then to the better rank (``build_tree``'s rule). Scores are recomputed from the
    rank path from scratch (no incremental update).
    """
    lp = log_probs.double().tolist()
    num_positions, vocab = len(lp), len(lp[0])
    top_k = min(budget, vocab)
    ranked = [sorted(range(vocab), key=lambda t, row=row: -row[t])[:top_k] for row in lp]

    def score(ranks: tuple[int, ...]) -> float:
        return sum(lp[d][ranked[d][r]] for d, r in enumerate(ranks))

    tokens, depths, parents, places = [], [], [-1], [0]  # places[i]: pop order of node i within its depth
    popped_at_depth = [0] * (num_positions + 1)
    heap = [(-score((0,)), 1, 0, 0, (0,), 0)]  # (-score, depth, parent's place, rank, rank path, parent)
    while heap and len(tokens) < budget:
        _, depth, parent_place, rank, ranks, parent = heapq.heappop(heap)
        tokens.append(ranked[depth - 1][rank])
        depths.append(depth)
        parents.append(parent)
        places.append(popped_at_depth[depth])
        popped_at_depth[depth] += 1
        me = len(tokens)
        if rank + 1 < top_k:
            sibling = ranks[:-1] + (rank + 1,)
            heapq.heappush(heap, (-score(sibling), depth, parent_place, rank + 1, sibling, parent))
        if depth < num_positions:
            child = ranks + (0,)
            heapq.heappush(heap, (-score(child), depth + 1, places[me], 0, child, me))
    return tokens, depths, parents


def naive_follow(
    node_tokens: list[int], parents: list[int], target_tokens: list[int]
) -> tuple[list[int], int]:
    children: dict[int, list[int]] = {}
    for node in range(1, len(parents)):
        children.setdefault(parents[node], []).append(node)
    path, current = [0], 0
    while True:
        nxt = [c for c in children.get(current, []) if node_tokens[c - 1] == target_tokens[current]]
        assert len(nxt) <= 1
        if not nxt:
            return path, target_tokens[current]
        current = nxt[0]
        path.append(current)


# --- TreeParams ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"budget": 0},
        {"budget": -3},
        {"budget": 4, "max_depth": 0},
        {"budget": 4, "max_depth": -1},
        {"budget": 4, "branching": 0},
        {"budget": 4, "branching": -2},
    ],
)
def test_tree_params_rejects_non_positive(kwargs):
    with pytest.raises(ValueError):
        TreeParams(**kwargs)


def test_tree_params_accepts_minimum_values():
    params = TreeParams(budget=1, max_depth=1, branching=1)
    assert (params.budget, params.max_depth, params.branching) == (1, 1, 1)
    assert TreeParams(budget=5).max_depth is None and TreeParams(budget=5).branching is None


# --- structural invariants ----------------------------------------------------------------------------


def test_random_trees_satisfy_invariants():
    for log_probs, params in random_cases(seed=1234, count=400):
        num_positions, vocab = log_probs.shape
        tree = build_tree(log_probs, params)
        depth_limit = depth_limit_of(num_positions, params)
        k = vocab if params.branching is None else min(vocab, params.branching)
        possible = sum(k**d for d in range(1, depth_limit + 1))
        n = tree.num_nodes
        ctx = f"L={num_positions} V={vocab} {params}"

        assert n == min(params.budget, possible), ctx
        assert tree.tokens.shape == (n,) and tree.depths.shape == (n,) and tree.log_probs.shape == (n,), ctx
        assert tree.parents.shape == (n + 1,) and tree.visibility.shape == (n + 1, n + 1), ctx
        assert tree.visibility.dtype == torch.bool, ctx

        parents = tree.parents.tolist()
        depths = [0] + tree.depths.tolist()
        tokens = [None] + tree.tokens.tolist()
        assert parents[0] == -1, ctx
        allowed = allowed_tokens(log_probs, params)
        children: dict[int, list[int]] = {}
        for node in range(1, n + 1):
            parent = parents[node]
            assert 0 <= parent < node, ctx
            assert depths[node] == depths[parent] + 1, ctx
            assert 1 <= depths[node] <= depth_limit, ctx
            assert 0 <= tokens[node] < vocab, ctx
            assert tokens[node] in allowed[depths[node] - 1], ctx
            children.setdefault(parent, []).append(node)
        for parent, kids in children.items():
            if params.branching is not None:
                assert len(kids) <= params.branching, ctx
            kid_tokens = [tokens[c] for c in kids]
            assert len(set(kid_tokens)) == len(kid_tokens), ctx

        rows = log_probs.tolist()
        expected_lp = [path_log_prob(rows, p) for p in node_paths(tree)]
        np.testing.assert_allclose(
            tree.log_probs.double().numpy(), expected_lp, rtol=0, atol=1e-5, err_msg=ctx
        )
        # Best-first: nodes come out in non-increasing path probability.
        assert bool((tree.log_probs[1:] <= tree.log_probs[:-1] + 1e-9).all()), ctx
        assert torch.equal(tree.visibility, naive_visibility(parents)), ctx


def test_budget_larger_than_all_prefixes_gives_full_tree():
    log_probs = torch.log_softmax(torch.tensor([[0.3, -0.2, 1.0], [0.5, 0.1, -1.0]], dtype=torch.float64), -1)
    tree = build_tree(log_probs, TreeParams(budget=64))
    assert tree.num_nodes == 3 + 9
    assert sorted(node_paths(tree)) == sorted(
        [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    )
    chain = build_tree(log_probs, TreeParams(budget=64, branching=1))
    assert node_paths(chain) == [(2,), (2, 0)]  # the argmax chain
    assert chain.parents.tolist() == [-1, 0, 1]
    shallow = build_tree(log_probs, TreeParams(budget=64, max_depth=1))
    assert shallow.depths.tolist() == [1, 1, 1]
    assert shallow.tokens.tolist() == [2, 0, 1]


def test_single_node_tree():
    log_probs = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0]] * 4), -1)
    tree = build_tree(log_probs, TreeParams(budget=1))
    assert tree.tokens.tolist() == [1]
    assert tree.depths.tolist() == [1]
    assert tree.parents.tolist() == [-1, 0]
    assert tree.visibility.tolist() == [[True, False], [True, True]]


# --- optimality against brute force -------------------------------------------------------------------


def test_tree_is_the_top_n_prefixes_brute_force():
    for log_probs, params in random_cases(seed=99, count=300):
        tree = build_tree(log_probs, params)
        everything = brute_force_log_probs(log_probs, params)
        n = tree.num_nodes
        best = np.sort(everything)[::-1][:n]
        rows = log_probs.tolist()
        ours = np.sort(np.array([path_log_prob(rows, p) for p in node_paths(tree)]))[::-1]
        assert len(everything) >= n
        ctx = f"L,V={tuple(log_probs.shape)} {params}"
        np.testing.assert_allclose(ours, best, rtol=0, atol=1e-5, err_msg=ctx)
        # The tree's own stored log-probs give the same multiset.
        np.testing.assert_allclose(np.sort(tree.log_probs.double().numpy())[::-1], best, rtol=0, atol=1e-5)


def test_a_depth_discount_keeps_the_top_n_prefixes_of_the_discounted_scores():
    """With depth_discount g a prefix scores sum_d g^(d-1) log p_d: the tree holds the n best prefixes
    by that score (brute force over every prefix) and is still prefix-closed."""
    rng = np.random.default_rng(5)
    for log_probs, params in random_cases(seed=123, count=200):
        gamma = float(rng.choice([0.3, 0.6, 0.9]))
        discounted = TreeParams(params.budget, params.max_depth, params.branching, depth_discount=gamma)
        tree = build_tree(log_probs, discounted)
        scaled = log_probs * torch.tensor([gamma**d for d in range(log_probs.shape[0])], dtype=log_probs.dtype)[:, None]
        best = np.sort(brute_force_log_probs(scaled, params))[::-1][: tree.num_nodes]
        ours = np.sort(np.array([path_log_prob(scaled.tolist(), p) for p in node_paths(tree)]))[::-1]
        np.testing.assert_allclose(ours, best, rtol=0, atol=1e-5, err_msg=f"{params} gamma={gamma}")
        assert all(int(tree.parents[i]) < i for i in range(1, tree.num_nodes + 1))
    assert TreeParams(8, depth_discount=1.0).depth_weights(3) is None
    with pytest.raises(ValueError, match="depth_discount"):
        TreeParams(8, depth_discount=1.5)


def test_tree_nodes_are_distinct_prefixes():
    for log_probs, params in random_cases(seed=7, count=100):
        paths = node_paths(build_tree(log_probs, params))
        assert len(set(paths)) == len(paths)


# --- equality with the reference algorithm ------------------------------------------------------------


def test_default_params_match_reference_algorithm():
    rng = np.random.default_rng(2024)
    for _ in range(300):
        num_positions = int(rng.integers(1, 8))
        vocab = int(rng.integers(2, 12))
        budget = int(rng.integers(1, 80))
        # float32 inputs, so the tree code's float32 top-K table holds exactly the reference's values.
        log_probs = random_log_probs(rng, num_positions, vocab, dtype=torch.float32)
        tree = build_tree(log_probs, TreeParams(budget=budget))
        tokens, depths, parents = reference_tree(log_probs, budget)
        ctx = f"L={num_positions} V={vocab} B={budget}"
        assert tree.tokens.tolist() == tokens, ctx
        assert tree.depths.tolist() == depths, ctx
        assert tree.parents.tolist() == parents, ctx


def test_full_caps_equal_reference():
    """max_depth = L and branching >= B must give the reference tree (DESIGN.md)."""
    rng = np.random.default_rng(5)
    for _ in range(100):
        num_positions, vocab = int(rng.integers(1, 7)), int(rng.integers(2, 9))
        budget = int(rng.integers(1, 65))
        log_probs = random_log_probs(rng, num_positions, vocab, dtype=torch.float32)
        capped = build_tree(log_probs, TreeParams(budget=budget, max_depth=num_positions, branching=budget))
        tokens, depths, parents = reference_tree(log_probs, budget)
        assert capped.tokens.tolist() == tokens
        assert capped.depths.tolist() == depths
        assert capped.parents.tolist() == parents


def test_exact_ties_broken_like_reference():
    """Integer log-probs (0 included) make many path sums tie exactly, within a depth and across
    depths; the shallower prefix, then the better-placed parent, then the better rank decides, as in
    the reference heap."""
    rng = random.Random(11)
    for _ in range(60):
        num_positions, vocab = rng.randint(1, 5), rng.randint(2, 6)
        rows = [[-float(v) for v in rng.sample(range(0, 8), vocab)] for _ in range(num_positions)]
        log_probs = torch.tensor(rows, dtype=torch.float32)
        budget = rng.randint(1, 40)
        tree = build_tree(log_probs, TreeParams(budget=budget))
        tokens, depths, parents = reference_tree(log_probs, budget)
        assert tree.tokens.tolist() == tokens
        assert tree.depths.tolist() == depths
        assert tree.parents.tolist() == parents


def test_accepts_reduced_precision_input():
    log_probs = torch.log_softmax(torch.randn(5, 16, generator=torch.Generator().manual_seed(3)), -1)
    tree32 = build_tree(log_probs, TreeParams(budget=20))
    tree16 = build_tree(log_probs.bfloat16(), TreeParams(budget=20))
    assert tree16.num_nodes == 20
    assert tree16.parents[0] == -1 and tree32.num_nodes == 20


# --- ancestor_matrix ----------------------------------------------------------------------------------


def test_ancestor_matrix_on_hand_built_tree():
    #        0
    #      1   2
    #     3 4   5
    #     6
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    vis = ancestor_matrix(parents, max_depth=3)
    assert torch.equal(vis, naive_visibility(parents.tolist()))
    assert vis[6].nonzero().squeeze(1).tolist() == [0, 1, 3, 6]
    assert vis[0].nonzero().squeeze(1).tolist() == [0]


# --- follow_tree --------------------------------------------------------------------------------------


def check_follow(tree: DraftTree, target: list[int]) -> tuple[list[int], int]:
    path, next_token = follow_tree(tree.tokens, tree.parents, tree.visibility, torch.tensor(target))
    expected_path, expected_next = naive_follow(tree.tokens.tolist(), tree.parents.tolist(), target)
    assert path.tolist() == expected_path
    assert int(next_token) == expected_next
    depths = [0] + tree.depths.tolist()
    assert path[0] == 0
    assert [depths[i] for i in path.tolist()] == list(range(len(path)))  # depth order, one per level
    assert int(next_token) == target[int(path[-1])]
    return expected_path, expected_next


def test_follow_tree_matches_naive_walk_on_random_targets():
    rng = np.random.default_rng(31)
    accepted_lengths = []
    for log_probs, params in random_cases(seed=31, count=200):
        vocab = log_probs.shape[1]
        tree = build_tree(log_probs, params)
        for _ in range(5):
            target = rng.integers(0, vocab, size=tree.num_nodes + 1).tolist()
            path, _ = check_follow(tree, target)
            accepted_lengths.append(len(path))
        # A target that mostly follows the drafter's argmax, so long paths appear too.
        target = [int(log_probs[min(d, log_probs.shape[0] - 1)].argmax()) for d in [0] + tree.depths.tolist()]
        accepted_lengths.append(len(check_follow(tree, target)[0]))
    assert max(accepted_lengths) >= 4 and min(accepted_lengths) == 1  # both short and long walks exercised


def test_follow_tree_accepts_a_whole_deepest_chain():
    rng = np.random.default_rng(77)
    for log_probs, params in random_cases(seed=77, count=150):
        vocab = log_probs.shape[1]
        tree = build_tree(log_probs, params)
        parents = tree.parents.tolist()
        tokens = [None] + tree.tokens.tolist()
        depths = [0] + tree.depths.tolist()
        deepest = max(range(len(depths)), key=lambda i: (depths[i], -i))
        chain = [deepest]
        while chain[-1] != 0:
            chain.append(parents[chain[-1]])
        chain.reverse()
        target = rng.integers(0, vocab, size=tree.num_nodes + 1).tolist()
        for parent, child in itertools.pairwise(chain):
            target[parent] = tokens[child]
        path, next_token = check_follow(tree, target)
        assert path == chain
        assert next_token == target[deepest]
        assert len(path) == depths[deepest] + 1


def test_follow_tree_rejects_at_root():
    log_probs = torch.log_softmax(torch.tensor([[3.0, 1.0, 0.0], [0.0, 3.0, 1.0]]), -1)
    tree = build_tree(log_probs, TreeParams(budget=1, branching=1))  # one node: token 0
    path, next_token = follow_tree(tree.tokens, tree.parents, tree.visibility, torch.tensor([2, 1]))
    assert path.tolist() == [0] and int(next_token) == 2
    path, next_token = follow_tree(tree.tokens, tree.parents, tree.visibility, torch.tensor([0, 1]))
    assert path.tolist() == [0, 1] and int(next_token) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_tree_build_kernels_equal_the_torch_build_on_cuda():
    """On CUDA ``build_tree`` runs ``tree_triton``'s kernels: the same tree as the torch build on the
    same top-K, bit for bit (exact ties included, within a depth and across depths), from budgets of 1 to
    1024, also replayed from a graph."""
    from workers.models.graph_cache import capture

    rng = np.random.default_rng(3)
    cases = [(rng.normal(size=(15, 5000)) * 3, TreeParams(budget)) for budget in (1, 16, 64, 256, 1024)]
    cases += [(np.round(rng.normal(size=(15, 50)) * 2), TreeParams(200, max_depth=9, branching=6))]  # ties
    certain = rng.normal(size=(15, 5000)) * 3
    certain[::3, 0] = 200.0  # every third position certain (log-prob 0): children tie their parents across depths
    cases += [(certain, TreeParams(budget)) for budget in (64, 1024)]
    cases += [(np.zeros((4, 3000)), TreeParams(budget)) for budget in (256, 1024)]  # uniform: a depth's candidates tie
    for _ in range(30):
        positions, vocab = int(rng.integers(1, 16)), int(rng.integers(2, 300))
        logits = rng.normal(size=(positions, vocab)) * rng.uniform(0.3, 4.0)
        cases.append((np.round(logits) if rng.random() < 0.5 else logits,
                      TreeParams(int(rng.integers(1, 300)), int(rng.integers(1, 16)), int(rng.integers(1, vocab + 2)))))
    for logits, params in cases:
        log_probs = torch.log_softmax(torch.tensor(logits, dtype=torch.float32, device="cuda"), dim=-1)
        want = build_tree(log_probs, params, kernels=False)
        graph, replayed = capture(lambda lp=log_probs, p=params: build_tree(lp, p))
        graph.replay()
        for got in (build_tree(log_probs, params), replayed):
            for name in ("tokens", "depths", "parents", "visibility", "log_probs"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (name, params)
