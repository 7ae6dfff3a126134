"""The target seam: refusing architectures we cannot run exactly, buckets, and cache compaction."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import Qwen3Config

from tests.helpers.reference import AttentionTarget
from workers.decoding.params import TreeParams
from workers.decoding.tree import build_tree
from workers.errors import UnsupportedModelError
from workers.seam import check_supported


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text"])
def test_hybrids_with_layers_we_cannot_fork_are_refused_by_name(model_type):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, num_hidden_layers=2,
                                  layer_types=["linear_attention", "sliding_attention"])
    with pytest.raises(UnsupportedModelError, match=f"'{model_type}' with layer types .*sliding_attention"):
        check_supported(config)
    check_supported(AutoConfig.for_model(model_type))  # the default hybrid layout is supported


def test_attention_target_refuses_a_hybrid_model(tiny_hybrid):
    with pytest.raises(UnsupportedModelError, match="hybrid model: use workers.models.runner.target.StaticTarget"):
        AttentionTarget(tiny_hybrid.model)


def test_unknown_and_sliding_window_targets_are_refused():
    config = Qwen3Config()
    config.model_type = "gpt2"
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        check_supported(config)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        check_supported(Qwen3Config(use_sliding_window=True, sliding_window=16, max_window_layers=0))


def test_bench_refuses_an_unsupported_target_folder_by_name(tmp_path):
    folder = tmp_path / "ssm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2, 3]}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "--target", str(folder), "--prompts", str(prompts), "--method", "ar"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "'mamba' is not supported" in proc.stderr


def test_tree_commit_moves_the_path_rows_and_matches_a_fresh_prefill(tiny):
    """After verifying a tree and committing one path, the cache must equal the cache of a plain
    prefill of prompt + path: same keys/values at every committed position, nothing beyond."""
    target = AttentionTarget(tiny.model, tiny.drafter.spec.target_layer_ids)
    prompt = torch.randint(1, 32, (1, 7), generator=torch.Generator().manual_seed(3))
    log_probs = torch.log_softmax(torch.randn(5, 33, generator=torch.Generator().manual_seed(4)), dim=-1)
    tree = build_tree(log_probs, TreeParams(budget=12, branching=3))
    deepest = int(tree.depths.argmax()) + 1
    path = [deepest]
    while path[-1] != 0:
        path.append(int(tree.parents[path[-1]]))
    path = torch.tensor(path[::-1])  # root .. deepest, not contiguous indices

    target.start(capacity=64, max_verify=13)
    target.prefill(prompt)
    root = torch.tensor(5)
    target.verify_tree(root, tree)
    target.commit(path)
    assert target.length == 7 + path.numel()

    reference = AttentionTarget(tiny.model, ())
    reference.start(capacity=64, max_verify=1)
    tokens = torch.cat((prompt[0], root.view(1), tree.tokens[path[1:] - 1]))
    reference.prefill(tokens.unsqueeze(0))
    for mine, theirs in zip(target.cache.layers, reference.cache.layers, strict=True):
        assert mine.keys.shape == theirs.keys.shape
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, rtol=1e-5, atol=1e-5)
    target.close()
    reference.close()
