"""The sweep file's prompts section: named datasets, sampling, chat settings, the thinking warning."""

from __future__ import annotations

import pandas as pd
import pytest

from orchestrator.config import load_sweep, thinking_warning
from orchestrator.sweep import main, validate
from tests.orchestrator.conftest import sweep_dict, write_sweep
from workers.errors import BadInputError
from workers.prompts import load_source


def test_named_dataset_from_a_local_copy(tiny_dir, tmp_path):
    local = tmp_path / "gsm8k.parquet"
    pd.DataFrame([{"question": f"q{i}", "answer": "1"} for i in range(10)]).to_parquet(local)
    config = sweep_dict(tiny_dir, tmp_path / "runs")
    config["prompts"] = {"dataset": "gsm8k", "path": str(local), "limit": 4, "seed": 3, "max_new_tokens": 8,
                         "chat_template": False}
    path = write_sweep(tmp_path / "sweep.yaml", config)
    loaded = load_sweep(path)
    prompts = load_source(loaded.prompts.source())
    assert len(prompts) == 4 and all(p.category == "math" and "\\boxed{}" in p.text for p in prompts)
    assert prompts == load_source(loaded.prompts.source())  # the seeded sample is stable
    # text prompts, and the tiny target has no tokenizer: refused before anything starts, naming the record
    with pytest.raises(BadInputError, match=rf"{local} record \d+: a text prompt needs a tokenizer"):
        validate(path)


@pytest.mark.parametrize(
    "prompts, message",
    [
        ({"max_new_tokens": 8}, "prompts: give a path, a dataset name, or both"),
        ({"dataset": "gsm9k"}, "prompts.dataset: Input should be"),
        ({"dataset": "gsm8k", "seed": "x"}, "prompts.seed"),
    ],
)
def test_bad_prompts_sections(tiny_dir, tmp_path, prompts, message):
    config = sweep_dict(tiny_dir, tmp_path / "runs")
    config["prompts"] = prompts
    with pytest.raises(BadInputError, match=message.replace(".", r"\.")):
        validate(write_sweep(tmp_path / "sweep.yaml", config))


def test_thinking_on_warns_when_the_drafter_does_not_declare_it(tiny_dir, tmp_path, capsys):
    config = sweep_dict(tiny_dir, tmp_path / "runs")
    config["prompts"]["enable_thinking"] = True
    path = write_sweep(tmp_path / "sweep.yaml", config)
    assert main([str(path), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "thinking mode is on" in err and "does not declare thinking" in err
    config["prompts"]["enable_thinking"] = False
    assert thinking_warning(validate(write_sweep(tmp_path / "quiet.yaml", config))) is None


def test_a_drafter_that_declares_thinking_gets_no_warning(tiny_dir, tmp_path):
    import json
    import shutil

    drafter = tmp_path / "drafter"
    shutil.copytree(tiny_dir / "drafter", drafter)
    raw = json.loads((drafter / "config.json").read_text())
    raw["dflash_config"]["thinking"] = True
    (drafter / "config.json").write_text(json.dumps(raw))
    config = sweep_dict(tiny_dir, tmp_path / "runs", drafter={"model": str(drafter)})
    config["prompts"]["enable_thinking"] = True
    assert thinking_warning(validate(write_sweep(tmp_path / "sweep.yaml", config))) is None
