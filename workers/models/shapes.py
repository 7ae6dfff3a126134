"""Named model shapes: the configs of the real targets and drafters, without their weights.

Used to plan placement on a meta device, to compute per-round memory for a 27B hybrid, and to build
random-weight models of the real size on a GPU (``--target random:qwen3-8b --drafter random:qwen3-8b``
wherever a model path is accepted) so speed can be measured without downloading checkpoints.

Sources: Qwen3-8B and its DFlash drafter (5 layers, block 16, target_layer_ids [1, 9, 17, 25, 33])
as in FIELD_NOTES; Qwen3.6-27B as published for Qwen3.5-27B (64 layers, every 4th full attention,
hidden 5120, 24 heads / 4 KV heads of 256 with a quarter rotary, GDN with 16 key and 48
value heads of 128, conv kernel 4, vocab 248320, untied) and its drafter as published
(z-lab/Qwen3.6-27B-DFlash: 5 layers of 32 heads / 8 KV heads of 128, 4 sliding + 1 full, window 2048);
Qwen3.8-27B (the same architecture) with its DFlash2 drafter as published (z-lab/Qwen3.8-27B-DFlash2).
"""

from __future__ import annotations

import torch

from workers.models.drafter_config import default_target_layer_ids

TARGETS: dict[str, dict] = {
    "qwen3-8b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    "qwen3.6-27b": {
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)],
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
}
TARGETS["qwen3.8-27b"] = TARGETS["qwen3.6-27b"]  # the same hybrid architecture (FIELD_NOTES 13)
# The 27B's first 32 layers, each of its size, in its pattern: about 30 GB in bf16, so its per-layer kernels,
# commits and passes can be timed on one 48 GB card (an RTX A6000), where the whole 55 GB does not fit
TARGETS["qwen3.6-27b-half"] = TARGETS["qwen3.6-27b"] | {"num_hidden_layers": 32,
                                                        "layer_types": TARGETS["qwen3.6-27b"]["layer_types"][:32]}
# Smoke-test sizes of the same layouts (4 layers, width 256): quick on a CPU, same code paths.
_MINI = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
TARGETS["qwen3-mini"] = TARGETS["qwen3-8b"] | _MINI
TARGETS["qwen3.6-mini"] = TARGETS["qwen3.6-27b"] | _MINI | {
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(4)],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
}

SLIDING, FULL = "sliding_attention", "full_attention"
# The published drafters' configs, weights aside (z-lab/Qwen3-8B-DFlash-b16: FIELD_NOTES 1.2;
# z-lab/Qwen3.6-27B-DFlash: FIELD_NOTES 13.1, ~1.73B parameters). Fields absent here come from the target.
DRAFTERS: dict[str, dict] = {
    "qwen3-8b": {  # every layer sees all context and the whole block
        "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 12288, "block_size": 16, "rope_theta": 1000000.0,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    },
    "qwen3.6-27b": {  # four causal sliding-window layers, then one full layer
        "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 17408, "block_size": 16, "layer_types": [SLIDING] * 4 + [FULL],
        "use_sliding_window": True, "sliding_window": 2048, "max_window_layers": 5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0},
        "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    },
    # DFlash2 (z-lab/Qwen3.8-27B-DFlash2; FIELD_NOTES 13): five non-causal sliding-window layers with the
    # dynamic convolutions, block 8, its own taps, and the candidate selector
    "qwen3.8-27b": {
        "architectures": ["DFlash2DraftModel"],
        "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 17408, "layer_types": [SLIDING] * 5, "is_causal": False,
        "use_sliding_window": True, "sliding_window": 2048, "max_window_layers": 5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0},
        "dflash_config": {"block_size": 8, "mask_token_id": 248070, "target_layer_ids": [5, 19, 33, 47, 61],
                          "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16},
    },
}
DRAFTERS["qwen3.6-27b-half"] = DRAFTERS["qwen3.6-27b"] | {"dflash_config": {
    **DRAFTERS["qwen3.6-27b"]["dflash_config"], "target_layer_ids": default_target_layer_ids(32, 5)}}
# the mini shapes' drafters keep the layout (the 27B's a window short enough to bind on a CPU smoke run)
_MINI_DRAFTER = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
                 "dflash_config": {"mask_token_id": _MINI["vocab_size"] - 1,
                                   "target_layer_ids": default_target_layer_ids(4, 5)}}
DRAFTERS["qwen3-mini"] = DRAFTERS["qwen3-8b"] | _MINI_DRAFTER
DRAFTERS["qwen3.6-mini"] = DRAFTERS["qwen3.6-27b"] | _MINI_DRAFTER | {"sliding_window": 64}
TARGETS["qwen3.8-mini"] = TARGETS["qwen3.6-mini"]
DRAFTERS["qwen3.8-mini"] = DRAFTERS["qwen3.8-27b"] | _MINI_DRAFTER | {"sliding_window": 64, "dflash_config": {
    **DRAFTERS["qwen3.8-27b"]["dflash_config"], **_MINI_DRAFTER["dflash_config"], "selector_rank": 32}}


def target_config(name: str):
    """A transformers config object for the named target shape."""
    from transformers import AutoConfig

    raw = dict(_known(TARGETS, name))
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def drafter_config(name: str) -> dict:
    """The DFlash drafter config (z-lab layout) published for the named target shape."""
    target, drafter = _known(TARGETS, name), _known(DRAFTERS, name)
    from_target = ("vocab_size", "hidden_size", "rms_norm_eps", "max_position_embeddings")
    return {k: target[k] for k in from_target} | {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_target_layers": target["num_hidden_layers"],
    } | drafter


def _known(table: dict[str, dict], name: str) -> dict:
    if name not in table:
        raise KeyError(f"unknown shape '{name}' (known: {', '.join(sorted(table))})")
    return table[name]


# -- random-weight models of a named shape ("random:qwen3-8b" wherever a model path is accepted) -----
def build_random_target(name: str, dtype: torch.dtype, device: torch.device):
    """A target of the named shape with random weights, initialised directly on ``device``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(target_config(name), dtype=dtype)
    return model.eval()


def build_random_drafter(name: str, target):
    """A DFlash (or DFlash2) drafter of the named target shape with random weights, beside the target's lm_head."""
    from workers.models.drafter2 import drafter_for
    from workers.models.drafter_config import DrafterSpec

    spec = DrafterSpec.from_dict(drafter_config(name), source=f"random:{name}")
    spec.check_fits(target.config, embedding_rows=target.get_input_embeddings().weight.shape[0],
                    source=f"random:{name}")
    lm_head = target.get_output_embeddings().weight
    with torch.device(lm_head.device):
        drafter = drafter_for(spec)
        if spec.selector is not None:  # codebooks start at zero (the selector would rank by logit alone)
            for codebook in (drafter.candidate_selector.predecessor_codebook,
                             drafter.candidate_selector.successor_codebook):
                torch.nn.init.normal_(codebook, std=0.02)
    return drafter.to(dtype=lm_head.dtype).eval()
