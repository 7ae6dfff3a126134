"""Named shapes: the real targets' configs (checked on a meta device) and random-weight models via
``random:<shape>`` wherever a model path is accepted, run end to end through ``tools.bench``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from workers.models.shapes import TARGETS, drafter_config, target_config


def test_the_27b_hybrid_shape_has_the_published_layout():
    from transformers import AutoModelForCausalLM

    config = target_config("qwen3.6-27b")
    assert config.layer_types.count("linear_attention") == 48 and config.layer_types.count("full_attention") == 16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    assert 26e9 < params < 28e9, params  # "27B"
    assert drafter_config("qwen3.6-27b")["dflash_config"]["target_layer_ids"] == [1, 16, 31, 46, 61]
    assert drafter_config("qwen3-8b")["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]


def test_the_27b_half_shape_is_the_27b_s_first_layers_and_fits_one_48_gb_card():
    """``qwen3.6-27b-half``: the 27B's first 32 layers (its sizes, its pattern), the drafter's taps spread
    over them, target and drafter in bf16 well inside 48 GB (room left for caches and graphs)."""
    from transformers import AutoModelForCausalLM

    from workers.models.drafter import DFlashDrafter
    from workers.models.drafter_config import DrafterSpec

    half, whole = target_config("qwen3.6-27b-half"), target_config("qwen3.6-27b")
    assert half.num_hidden_layers == 32 and half.layer_types == whole.layer_types[:32]
    assert all(getattr(half, key) == getattr(whole, key) for key in ("hidden_size", "intermediate_size",
               "num_attention_heads", "linear_num_value_heads", "vocab_size"))
    spec = DrafterSpec.from_dict(drafter_config("qwen3.6-27b-half"))
    assert spec.target_layer_ids == (1, 8, 15, 22, 29)
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(half, dtype=torch.bfloat16)
        spec.check_fits(target.config, target.get_input_embeddings().weight.shape[0], "random:qwen3.6-27b-half")
        params = sum(p.numel() for p in target.parameters()) + sum(p.numel() for p in DFlashDrafter(spec).parameters())
    assert 14e9 < params < 17e9 and 2 * params < 36e9, params


def test_the_27b_drafter_shape_is_the_published_one():
    """z-lab/Qwen3.6-27B-DFlash: 5 layers of 32 heads / 8 KV heads of 128, four causal sliding-window
    layers (window 2048) and one full layer, taps [1, 16, 31, 46, 61], about 1.73B parameters."""
    from workers.models.drafter import DFlashDrafter
    from workers.models.drafter_config import DrafterSpec, LayerAttention

    spec = DrafterSpec.from_dict(drafter_config("qwen3.6-27b"))
    sliding, full = LayerAttention(causal=True, window=2048), LayerAttention(causal=False, window=None)
    assert spec.layer_attention == (sliding,) * 4 + (full,)
    assert spec.target_layer_ids == (1, 16, 31, 46, 61) and spec.mask_token_id == 248070 and spec.block_size == 16
    cfg = spec.qwen3_config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    with torch.device("meta"):
        params = sum(p.numel() for p in DFlashDrafter(spec).parameters())
    assert 1.70e9 < params < 1.76e9, params
    assert DrafterSpec.from_dict(drafter_config("qwen3-8b")).layer_attention == (full,) * 5


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.bench", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # the bench CLI in subprocesses
def test_bench_runs_random_weight_shapes_without_checkpoints():
    for shape in ("qwen3-mini", "qwen3.6-mini"):
        proc = bench("--target", f"random:{shape}", "--drafter", f"random:{shape}", "--method", "ddtree",
                     "--tree-budget", "8", "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "8",
                     "--prompt-length", "24", "--limit", "2", "--json")
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        assert result["status"] == "ok" and result["metrics"]["lossless_match"] == 1.0
        assert len(result["outputs"]) == 2 and all(len(o["token_ids"]) == 8 for o in result["outputs"])
        assert ("tree_state_bytes" in result["metrics"]) == (shape == "qwen3.6-mini")


def test_an_unknown_shape_is_refused_by_name():
    proc = bench("--target", "random:qwen9-1t", "--method", "ar", "--device", "cpu")
    assert proc.returncode == 2
    assert "unknown shape 'qwen9-1t'" in proc.stderr and "qwen3.6-27b" in proc.stderr
    assert set(TARGETS) >= {"qwen3-8b", "qwen3.6-27b"}
