"""``python -m tools.tiny``: the demo's models, for every architecture, including the short
drafter distillation (it reads the target's taps outside inference mode, then trains on them)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from safetensors.torch import load_file


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "qwen3_next"])
@pytest.mark.slow  # the CLI in a subprocess
def test_tiny_cli_writes_models_and_distills_the_drafter(tmp_path, arch):
    folder = tmp_path / arch
    proc = subprocess.run(
        [sys.executable, "-m", "tools.tiny", str(folder), "--arch", arch, "--distill-steps", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    before = load_file(folder / "drafter" / "model.safetensors")

    from tools.tiny import distill_drafter

    distill_drafter(folder / "target", folder / "drafter", steps=3, sequences=2)
    after = load_file(folder / "drafter" / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not (before[k] == after[k]).all() for k in before), "training changed nothing"
    assert (folder / "prompts.jsonl").read_text().count("\n") == 8


@pytest.mark.slow  # the CLI in a subprocess
def test_distillation_reports_progress(tmp_path):
    """The first `make demo` spends minutes training the drafter: the CLI shows a bar for it, and
    distill_drafter reports every sequence and step to its callback."""
    folder = tmp_path / "pair"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.tiny", str(folder), "--distill-steps", "3", "--distill-sequences", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "training the tiny drafter" in proc.stderr and "3 steps" in proc.stderr
    assert "generating" in proc.stderr and "2/2" in proc.stderr and "3/3" in proc.stderr

    from tools.tiny import distill_drafter

    calls: list[tuple[str, int, int]] = []
    distill_drafter(folder / "target", folder / "drafter", steps=2, sequences=2,
                    progress=lambda phase, done, total: calls.append((phase, done, total)))
    assert calls == [("generating", 1, 2), ("generating", 2, 2), ("training", 1, 2), ("training", 2, 2)]
