"""``python -m workers.tiny``: the demo's models, for every architecture, including the short
drafter distillation (it reads the target's taps outside inference mode, then trains on them)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from safetensors.torch import load_file


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "qwen3_next"])
def test_tiny_cli_writes_models_and_distills_the_drafter(tmp_path, arch):
    folder = tmp_path / arch
    proc = subprocess.run(
        [sys.executable, "-m", "workers.tiny", str(folder), "--arch", arch, "--distill-steps", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    before = load_file(folder / "drafter" / "model.safetensors")

    from workers.tiny import distill_drafter

    distill_drafter(folder / "target", folder / "drafter", steps=3, sequences=2)
    after = load_file(folder / "drafter" / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not (before[k] == after[k]).all() for k in before), "training changed nothing"
    assert (folder / "prompts.jsonl").read_text().count("\n") == 8
