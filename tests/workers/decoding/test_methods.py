"""The method registry owns each method's rules (``workers.decoding.methods``): its parameters from a
flat setting, its verify width, its replayed rounds; and nothing outside ``workers.decoding``
decides by a method's name."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest
import torch

from workers.decoding.methods import METHODS, Method, entry, entry_of
from workers.decoding.params import ARParams, DFlashParams, TreeParams, tree_size
from workers.decoding.tree import build_tree

ROOT = Path(__file__).resolve().parents[3]
NAMES = {method.value for method in Method}


@pytest.mark.parametrize("seed", range(40))
def test_tree_size_is_the_node_count_of_the_tree_built(seed):
    rng = random.Random(seed)
    rows, vocab = rng.randint(1, 7), rng.choice([2, 3, 5, 40])
    params = TreeParams(rng.choice([1, 2, 3, 7, 20, 64, 300]), rng.choice([None, 1, 2, 3, 6]),
                        rng.choice([None, 1, 2, 3, 5]))
    log_probs = torch.log_softmax(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)), dim=-1)
    tree = build_tree(log_probs, params, kernels=False)
    depth_limit = rows if params.max_depth is None else min(params.max_depth, rows)
    assert tree.num_nodes == tree_size(params, depth_limit, vocab)


def test_a_depth_and_branching_capped_tree_is_priced_at_its_own_width():
    """Budget 289 at depth 4 and branching 2 holds 2 + 4 + 8 + 16 = 30 nodes: its verify pass is 31 wide
    (the predictor once priced it at 290)."""
    ddtree = entry(Method.DDTREE)
    assert ddtree.verify_width(TreeParams(289, 4, 2), block_size=16) == 31
    assert ddtree.verify_width(TreeParams(289), block_size=16) == 290
    assert ddtree.verify_width(TreeParams(10, 1, None), block_size=16) == 11
    assert entry(Method.DFLASH).verify_width(DFlashParams(), block_size=16) == 16
    assert entry(Method.DFLASH).verify_width(DFlashParams(5), block_size=16) == 6
    assert entry(Method.AR).verify_width(ARParams(), block_size=16) == 1


def test_params_from_a_flat_setting_are_checked():
    ddtree = entry("ddtree")
    setting = {"tree_budget": 8, "max_depth": None, "branching": 2}
    assert ddtree.params_from(setting, block_size=6) == TreeParams(8, 5, 2)
    with pytest.raises(ValueError, match="tree_budget"):
        ddtree.params_from({"max_depth": 3})
    with pytest.raises(ValueError, match="num_draft_tokens"):
        ddtree.params_from({"tree_budget": 8, "num_draft_tokens": 3})
    with pytest.raises(ValueError, match="exceeds the drafter's block_size-1"):
        entry("dflash").params_from({"num_draft_tokens": 9}, block_size=8)
    for method, method_entry in METHODS.items():
        assert entry_of(method_entry.params_from({"tree_budget": 4} if method is Method.DDTREE else {})) is method_entry


def test_replay_plans_cover_the_widest_setting():
    ddtree = entry(Method.DDTREE)
    plan = ddtree.replay_plan([TreeParams(64, 3, 2), TreeParams(512, None, 8), TreeParams(16)], 16)
    assert (plan.top_k, plan.ceiling) == (512, 512)  # cut from the ceiling's trees, unlimited branching reads 512
    plan = ddtree.replay_plan([TreeParams(64, 3, 2), TreeParams(512, None, 8)], 16)
    assert (plan.top_k, plan.ceiling) == (8, 512)  # ... here the widest branching is 8
    merged = plan.merge(entry(Method.DFLASH).replay_plan([DFlashParams()], 16))
    assert (merged.top_k, merged.ceiling) == (8, 512)


def _name_comparisons(path: Path) -> list[str]:
    """Comparisons of something with a method's name ("ddtree") or member (Method.DDTREE) in ``path``."""
    found, where = [], path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            elements = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            for element in elements:
                literal = isinstance(element, ast.Constant) and element.value in NAMES
                member = isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name) and (
                    element.value.id == "Method")
                if literal or member:
                    found.append(f"{where}:{node.lineno}")
    return found


def test_no_code_outside_workers_decoding_decides_by_a_method_name():
    outside = [p for folder in ("workers", "orchestrator", "benchmarks") for p in (ROOT / folder).rglob("*.py")
               if "decoding" not in p.relative_to(ROOT).parts]
    found = [hit for path in outside for hit in _name_comparisons(path)]
    assert not found, found


def test_the_name_check_sees_a_comparison(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f(method):\n    return method == 'ddtree' or method in (Method.AR,)\n")
    assert _name_comparisons(planted) == ["planted.py:2", "planted.py:2"]
