"""The cost table and the predicted speed (``workers.costs``), and the benchmark that compares them
with real trials (run in a subprocess that cannot import Ray, Optuna, MLflow or pydantic)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.costs import CostTable, measure_costs, predict
from workers.decoding.generation import GenerationConfig
from workers.decoding.methods import Method, entry, entry_of
from workers.decoding.params import ARParams, DFlashParams, TreeParams
from workers.decoding.replay import record

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TREES = [TreeParams(b, d, k) for b in (2, 8, 32) for d in (2, None) for k in (2, None)]
SETTINGS = [*TREES, DFlashParams(2), DFlashParams(), ARParams()]
CONTEXTS = (16, 40)


@pytest.fixture(scope="module")
def costs(tiny_small_vocab) -> CostTable:
    tiny = tiny_small_vocab
    prompt = torch.randint(1, 6, (1, 8), generator=torch.Generator().manual_seed(0))
    return measure_costs(tiny.target, tiny.drafter, SETTINGS, CONTEXTS, calibration_prompt=prompt,
                         calibration=GenerationConfig(16))


def test_the_table_covers_every_piece_a_setting_uses(costs):
    assert set(costs.advance_s) == set(costs.verify_s) == set(CONTEXTS)  # each pass at both context lengths
    for table in costs.verify_s.values():
        assert set(table) == {"chain", "2", "None"}
        assert set(table["chain"]) == {3, 6}  # DFlash's chains of 2 and of block_size-1 = 5, the root first
        assert all(set(by_depth) == {2, 5} and all(set(b) == {2, 8, 32} for b in by_depth.values())
                   for kind, by_depth in table.items() if kind != "chain")
    assert set(costs.commit_s) == set(range(1, 7)) and set(costs.draft_s) == {1, 6}
    assert set(costs.tree_s) == {"2", "None"} and all(set(d) == {2, 5} for d in costs.tree_s.values())
    assert all(v > 0 for table in (costs.advance_s, costs.commit_s, costs.draft_s) for v in table.values())
    assert set(costs.overhead_s) == {"ddtree", "dflash"}  # AR's round is its advance alone
    chain = entry(Method.DFLASH).round_shape(DFlashParams(2), 6)
    low, high = costs.verify(chain, 16), costs.verify(chain, 40)
    assert costs.verify(chain, 28) == pytest.approx((low + high) / 2)  # linear between the two contexts
    assert costs.verify(chain, 1000) == high  # flat beyond them
    assert costs.tree(TreeParams(4, 2, 3)) > 0  # an unmeasured branching borrows the nearest measured one
    assert CostTable.from_dict(costs.to_dict()) == costs


@pytest.mark.parametrize("family", ["ddtree", "dflash", "ar"])
def test_prediction_counts_the_real_rounds(tiny_small_vocab, costs, family):
    """tokens/s = tokens / sum of round costs, over exactly the rounds the engine runs, each priced at
    its own context length."""
    tiny = tiny_small_vocab
    prompts = [torch.randint(1, 6, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]
    config = GenerationConfig(20, stop_token_ids=(0,))
    tables = [record(tiny.target, tiny.drafter, p, config, top_k=32) for p in prompts]
    for params in [p for p in SETTINGS if p.METHOD == family]:
        method = entry_of(params)
        outs = [method.generate(tiny.target, tiny.drafter, p, config, params) for p in prompts]
        predicted = predict(tables, costs, params, 6, ceiling=32)
        assert predicted.rounds == sum(o.num_rounds for o in outs)
        assert predicted.tokens == sum(len(o.token_ids) for o in outs)
        lengths = [length for o in outs for length in o.acceptance_lengths]
        assert predicted.tau == pytest.approx(sum(lengths) / len(lengths))
        shape = method.round_shape(params, 6)
        expected = 0.0
        for prompt, out in zip(prompts, outs, strict=True):  # width, path, previous commit, context
            context, previous = prompt.shape[1] + 1, 6  # the first drafter pass reads the prompt: a full block
            for length in out.acceptance_lengths:
                expected += costs.round_s(shape, length, previous, context)
                previous, context = length, context + length
        assert predicted.decode_s == pytest.approx(expected) and expected > 0
        assert predicted.tokens_per_s == pytest.approx(predicted.tokens / predicted.decode_s)


BLOCK_HEAVY = "import sys\nfor name in ('ray', 'optuna', 'mlflow', 'pydantic'):\n    sys.modules[name] = None\n"


@pytest.mark.slow  # the benchmark in a subprocess
def test_benchmark_runs_without_ray_optuna_mlflow_pydantic(tmp_path):
    script = BLOCK_HEAVY + (
        "import runpy\nsys.argv = ['predict_vs_measure.py', '--limit', '1', '--max-new-tokens', '10', "
        "'--budgets', '2,8', '--depths', 'None', '--branchings', 'None', '--method', 'ddtree,dflash', "
        f"'--out', {str(tmp_path / 'result.md')!r}]\n"
        f"runpy.run_path({str(ROOT / 'benchmarks' / 'predict_vs_measure.py')!r}, run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "pred tok/s" in out and "|predicted - measured| / measured over 7 settings: median" in out
    rows = [line for line in out.splitlines() if line.startswith("| ddtree ") or line.startswith("| dflash ")]
    assert len(rows) == 7  # 2 trees, 5 chains (block 6)
    for row in rows:  # greedy float32: predicted tau equals the measured one
        fields = [field.strip() for field in row.strip("|").split("|")]
        assert fields[4] == fields[5], row
    assert (tmp_path / "result.md").read_text().count("\n| ") == 8  # the header and the rows
