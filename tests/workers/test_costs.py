"""The cost table and the predicted speed (``workers.costs``), and the benchmark that compares them
with real trials (run in a subprocess that cannot import Ray, Optuna, MLflow or pydantic)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.costs import CostTable, measure_costs, predict
from workers.decoding import ddtree
from workers.decoding.generation import GenerationConfig
from workers.decoding.methods import Method, entry
from workers.decoding.params import TreeParams
from workers.decoding.replay import record

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

SETTINGS = [TreeParams(b, d, k) for b in (2, 8, 32) for d in (2, None) for k in (2, None)]


@pytest.fixture(scope="module")
def costs(tiny_small_vocab) -> CostTable:
    tiny = tiny_small_vocab
    prompt = torch.randint(1, 6, (1, 8), generator=torch.Generator().manual_seed(0))
    return measure_costs(tiny.target, tiny.drafter, SETTINGS, context_length=16,
                         calibration_prompt=prompt, calibration=GenerationConfig(16))


def test_the_table_covers_every_piece_a_setting_uses(costs):
    # root only, and root + the nodes a tree can hold: the budget, or 2 + 4 = 6 at depth 2, branching 2
    assert set(costs.verify_s) == {1, 3, 7, 9, 33}
    assert set(costs.commit_s) == set(range(1, 7)) and set(costs.draft_s) == {1, 6}
    assert set(costs.tree_s) == {"2", "None"} and all(set(d) == {2, 5} for d in costs.tree_s.values())
    assert all(v > 0 for table in (costs.verify_s, costs.commit_s, costs.draft_s) for v in table.values())
    assert set(costs.overhead_s) == {"ddtree"}
    # between anchors: linear; beyond them: flat
    low, high = costs.verify(9), costs.verify(33)
    assert costs.verify(21) == pytest.approx((low + high) / 2)
    assert costs.verify(100) == high
    assert costs.tree(TreeParams(4, 2, 3)) > 0  # an unmeasured branching borrows the nearest measured one
    assert CostTable.from_dict(costs.to_dict()) == costs


def test_prediction_counts_the_real_rounds(tiny_small_vocab, costs):
    """tokens/s = tokens / sum of round costs, over exactly the rounds the engine runs."""
    tiny = tiny_small_vocab
    prompts = [torch.randint(1, 6, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]
    config = GenerationConfig(20, stop_token_ids=(0,))
    tables = [record(tiny.target, tiny.drafter, p, config, top_k=32) for p in prompts]
    for params in SETTINGS:
        outs = [ddtree.generate(tiny.target, tiny.drafter, p, config, params) for p in prompts]
        predicted = predict(tables, costs, params, 6, ceiling=32)
        assert predicted.rounds == sum(o.num_rounds for o in outs)
        assert predicted.tokens == sum(len(o.token_ids) for o in outs)
        lengths = [length for o in outs for length in o.acceptance_lengths]
        assert predicted.tau == pytest.approx(sum(lengths) / len(lengths))
        expected = 0.0
        for out in outs:  # each round priced by its width, its path and the previous round's commit
            previous = 6  # the first drafter pass reads the prompt: priced as a full block
            for length in out.acceptance_lengths:
                expected += costs.round_s(entry(Method.DDTREE).round_shape(params, 6), length, previous)
                previous = length
        assert predicted.decode_s == pytest.approx(expected) and expected > 0
        assert predicted.tokens_per_s == pytest.approx(predicted.tokens / predicted.decode_s)


BLOCK_HEAVY = "import sys\nfor name in ('ray', 'optuna', 'mlflow', 'pydantic'):\n    sys.modules[name] = None\n"


def test_benchmark_runs_without_ray_optuna_mlflow_pydantic(tmp_path):
    script = BLOCK_HEAVY + (
        "import runpy\nsys.argv = ['predict_vs_measure.py', '--prompts', '1', '--max-new-tokens', '10', "
        "'--budgets', '2,8', '--depths', 'None', '--branchings', 'None', '--top', '1', '--explore', '0']\n"
        f"runpy.run_path({str(ROOT / 'benchmarks' / 'predict_vs_measure.py')!r}, run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "pred tok/s" in out and "exhaustive grid : 2 trials" in out and "predicted       : 1 trials" in out
    rows = [line for line in out.splitlines() if line.startswith("{'tree_budget'")]
    assert len(rows) == 2
    for row in rows:  # greedy float32: predicted tau equals the measured one
        fields = row.split("}")[1].split()
        assert fields[3] == fields[4], row
