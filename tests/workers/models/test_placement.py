"""The two-GPU split plan for the user's real target, computed on a meta device (no GPU needed).

Qwen3.6-27B-shaped (64 layers, 48 GDN + 16 attention, ~50 GiB of bf16 weights) with its
DFlash drafter over 2 x 48 GB: every layer placed on a GPU, lm_head and the drafter together on the
last one, the runtime reserve (caches, tree buffers, logits) left free on each, the weights balanced.
"""

from __future__ import annotations

import pytest
import torch

from workers.errors import BadInputError
from workers.models.gdn import tree_state_bytes
from workers.models.placement import (
    FIXED_BYTES,
    GiB,
    RunBudget,
    drafter_bytes_for,
    graph_activation_bytes,
    head_bytes,
    layer_state_bytes,
    plan_split,
)
from workers.models.shapes import drafter_config, target_config

GB48 = 48 * 10**9  # an RTX A6000's 48 GB


@pytest.fixture(scope="module")
def hybrid_27b():
    from workers.models.drafter_config import DrafterSpec

    config = target_config("qwen3.6-27b")
    drafter = drafter_bytes_for(DrafterSpec.from_dict(drafter_config("qwen3.6-27b")), torch.bfloat16)
    return config, drafter


def test_27b_hybrid_splits_over_two_48gb_gpus_with_headroom(hybrid_27b):
    config, drafter = hybrid_27b
    budget = RunBudget(max_tokens=16384, max_verify=1025)
    plan = plan_split(config, [GB48, GB48], torch.bfloat16, drafter_bytes=drafter, budget=budget)
    placed = {}
    for name, gpu in plan.device_map.items():
        assert gpu in (0, 1), (name, gpu)
        if name.startswith("model.layers."):
            placed[int(name.split(".")[2])] = gpu
    assert sorted(placed) == list(range(64))  # every decoder layer, each once
    assert [placed[i] for i in range(64)] == sorted(placed.values())  # contiguous: 0...0 1...1
    assert set(placed.values()) == {0, 1}
    assert plan.device_map["lm_head"] == plan.device_map["model.norm"] == 1 == plan.drafter_gpu
    assert plan.device_map["model.embed_tokens"] == 0

    assert 49 * GiB < sum(plan.weight_bytes) < 52 * GiB  # ~50 GiB of bf16 weights, all accounted
    assert 3 * GiB < drafter < 4 * GiB
    for gpu in (0, 1):  # the reserve holds at least the state of the layers there and the fixed part
        layers = [i for i, g in placed.items() if g == gpu]
        state = sum(layer_state_bytes(config, config.layer_types[i], budget, torch.bfloat16) for i in layers)
        assert plan.reserve_bytes[gpu] >= FIXED_BYTES + state
        assert plan.free_bytes()[gpu] > 2 * GiB, plan.describe()
    assert plan.reserve_bytes[1] >= FIXED_BYTES + drafter  # the drafter sits with lm_head
    # the linear layers' share of the reserve covers the B=1024 tree data of every layer
    assert sum(plan.reserve_bytes) > tree_state_bytes(config, 1025) + drafter + 2 * FIXED_BYTES
    assert abs(plan.free_bytes()[0] - plan.free_bytes()[1]) < 6 * GiB, plan.describe()  # balanced
    assert "lm_head + drafter" in plan.describe().splitlines()[2]


def test_a_weight_cap_per_gpu_is_honoured(hybrid_27b):
    config, drafter = hybrid_27b
    plan = plan_split(config, [GB48, GB48], torch.bfloat16, drafter_bytes=drafter, weight_cap=29 * GiB)
    assert all(weights <= 29 * GiB for weights in plan.weight_bytes)
    with pytest.raises(BadInputError, match=r"50\.\d GiB of weights do not pack .* raise max_memory_per_gpu"):
        plan_split(config, [GB48, GB48], torch.bfloat16, drafter_bytes=drafter, weight_cap=26 * GiB)


def test_gpus_too_small_are_refused_with_the_numbers(hybrid_27b):
    config, drafter = hybrid_27b
    with pytest.raises(BadInputError, match=r"weights need 50\.\d GiB but 2 GPU\(s\) of 22 \+ 22 GiB"):
        plan_split(config, [24 * 10**9, 24 * 10**9], torch.bfloat16, drafter_bytes=drafter)


def test_an_attention_model_on_one_gpu_goes_whole(hybrid_27b):
    plan = plan_split(target_config("qwen3-8b"), [GB48], torch.bfloat16)
    assert set(plan.device_map.values()) == {0} and plan.drafter_gpu == 0
    assert 14 * GiB < plan.weight_bytes[0] < 16 * GiB


def test_the_multimodal_checkpoint_config_plans_its_language_model(hybrid_27b):
    """Released Qwen3.5/3.6 checkpoints carry a composite config (text_config inside)."""
    from transformers import AutoConfig

    from workers.models.shapes import TARGETS

    text = {k: v for k, v in TARGETS["qwen3.6-27b"].items() if k != "model_type"}
    composite = AutoConfig.for_model("qwen3_5", text_config=text)
    plan = plan_split(composite, [GB48, GB48], torch.bfloat16, drafter_bytes=hybrid_27b[1])
    assert sum(name.startswith("model.layers.") for name in plan.device_map) == 64
    assert plan.device_map["lm_head"] == 1 and min(plan.free_bytes()) > 2 * GiB


def test_the_reserve_counts_each_kept_graphs_pool(hybrid_27b):
    """Each captured width keeps its own logits, GDN pending data and activations (on every GPU); the
    prompt chunk's captured pass one more pool of activations."""
    config, drafter = hybrid_27b
    eager, graphs = RunBudget(graph_widths=0), RunBudget(graph_widths=4)
    pending = tree_state_bytes(config, graphs.max_verify)
    logits = graphs.max_verify * config.vocab_size * 2
    assert head_bytes(config, graphs, torch.bfloat16) - head_bytes(config, eager, torch.bfloat16) == 4 * logits
    linear = [layer_state_bytes(config, "linear_attention", b, torch.bfloat16) for b in (eager, graphs)]
    assert abs((linear[1] - linear[0]) * 48 - 4 * pending) < 48 * 4  # (integer division per layer)
    activations = graph_activation_bytes(config, graphs, torch.bfloat16)
    assert 0.5 * GiB < activations < 1 * GiB  # width 1025 on the 27B shape
    plans = [plan_split(config, [GB48, GB48], torch.bfloat16, drafter_bytes=drafter, budget=b) for b in (eager, graphs)]
    grown = sum(plans[1].reserve_bytes) - sum(plans[0].reserve_bytes)
    assert graphs.activation_pools == 5 and eager.activation_pools == 0
    expected = 4 * logits + 2 * 5 * activations + (linear[1] - linear[0]) * 48
    assert abs(grown - expected) < 2**20, (grown, expected)
    assert min(plans[1].free_bytes()) > 2 * GiB, plans[1].describe()  # the user's 2 x 48 GB still fits


# -- tensor parallel ------------------------------------------------------------------------------------
def test_27b_hybrid_tensor_parallel_plan_per_rank(hybrid_27b):
    from workers.models.placement import plan_tensor_parallel

    config, drafter = hybrid_27b
    one = plan_tensor_parallel(config, 200 * GiB, 1, torch.bfloat16, drafter)
    two = plan_tensor_parallel(config, GB48, 2, torch.bfloat16, drafter)
    # sharded layers halve; the embedding (and norms, routers) stay whole on each rank
    embedding = config.text_config.vocab_size * config.text_config.hidden_size * 2 if hasattr(
        config, "text_config") else config.vocab_size * config.hidden_size * 2
    assert one.weight_bytes / 2 < two.weight_bytes <= one.weight_bytes / 2 + embedding
    assert two.state_bytes < one.state_bytes * 0.51  # K/V and GDN state of half the heads
    assert two.drafter_bytes == drafter and two.free_bytes() > 0
    with pytest.raises(BadInputError, match=r"tensor_parallel=2 leaves each GPU .* GiB short .*weights"):
        plan_tensor_parallel(config, 24 * 10**9, 2, torch.bfloat16, drafter)


def test_tensor_parallel_plan_refuses_a_head_count_that_does_not_divide(hybrid_27b):
    from workers.models.placement import plan_tensor_parallel

    config, drafter = hybrid_27b
    with pytest.raises(BadInputError, match=r"tensor_parallel=3: the target's \w+=\d+ does not divide by 3"):
        plan_tensor_parallel(config, GB48, 3, torch.bfloat16, drafter)
