"""Tests for workers.models.drafter: loading z-lab DFlash checkpoints, refusing mismatched ones, and the
drafter forward's independence from how the context is fed.

Broken checkpoints are made by copying the session's good tiny drafter into tmp_path and editing
config.json or rewriting the safetensors file; the target is always the `tiny` fixture's model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tools.tiny import TinyShape, tiny_drafter_config, write_tiny_pair
from workers.errors import BadInputError, CheckpointMismatchError
from workers.models.drafter import DFlashDrafter
from workers.models.drafter_config import DrafterSpec, default_target_layer_ids
from workers.models.loading import WEIGHTS_FILE, WEIGHTS_INDEX_FILE, Placement, load_drafter, load_target

# --- helpers ------------------------------------------------------------------------------------------


def zlab_keys(num_layers: int) -> set[str]:
    """The exact key names of a z-lab DFlash drafter with `num_layers` layers."""
    keys = {"norm.weight", "fc.weight", "hidden_norm.weight"}
    for n in range(num_layers):
        keys |= {f"layers.{n}.self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")}
        keys |= {f"layers.{n}.self_attn.{p}_norm.weight" for p in ("q", "k")}
        keys |= {f"layers.{n}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        keys |= {f"layers.{n}.{p}_layernorm.weight" for p in ("input", "post_attention")}
    return keys


def file_keys(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as handle:
        return set(handle.keys())


def drafter_weights(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    return {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].shape == value.shape, key
        assert got[key].dtype == value.dtype, key
        assert torch.equal(got[key], value), key


def edit_config(folder: Path, change: Callable[[dict], None]) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw, indent=2))


Weights = dict[str, torch.Tensor]


def edit_weights(folder: Path, change: Callable[[Weights], Weights | None]) -> None:
    path = folder / WEIGHTS_FILE
    weights = load_file(path)
    result = change(weights)
    save_file(result if result is not None else weights, path)


@pytest.fixture
def good_copy(tiny, tmp_path) -> Path:
    """A private copy of the good tiny drafter checkpoint, safe to break."""
    folder = tmp_path / "drafter"
    shutil.copytree(tiny.drafter_dir, folder)
    return folder


# --- loading a good checkpoint ------------------------------------------------------------------------


def test_saved_file_uses_exact_zlab_key_names(tiny):
    keys = file_keys(tiny.drafter_dir / WEIGHTS_FILE)
    assert keys == zlab_keys(tiny.shape.drafter_layers)
    assert not any(k.startswith("rotary_emb") for k in keys)


def test_loaded_state_dict_equals_saved_tensors(tiny):
    drafter = load_drafter(str(tiny.drafter_dir), tiny.model)
    assert isinstance(drafter, DFlashDrafter)
    assert not drafter.training
    saved = load_file(tiny.drafter_dir / WEIGHTS_FILE)
    assert_same_weights(drafter_weights(drafter), saved)
    assert drafter.fc.weight.dtype == tiny.model.get_output_embeddings().weight.dtype
    spec = drafter.spec
    raw = json.loads((tiny.drafter_dir / "config.json").read_text())
    assert spec.block_size == raw["block_size"] == tiny.shape.block_size
    assert spec.mask_token_id == raw["dflash_config"]["mask_token_id"]
    assert list(spec.target_layer_ids) == raw["dflash_config"]["target_layer_ids"]
    assert spec.num_target_layers == tiny.model.config.num_hidden_layers
    assert spec.hidden_size == tiny.model.config.hidden_size


def test_fresh_pair_with_other_shape_round_trips(tmp_path):
    """write_tiny_pair in a new folder with a non-default shape: keys and weights survive the trip."""
    shape = TinyShape(
        vocab_size=20, hidden_size=48, num_layers=6, num_heads=6, num_kv_heads=3, intermediate_size=40,
        drafter_layers=3, block_size=5,
    )
    target_dir, drafter_dir = write_tiny_pair(tmp_path, shape, seed=3)
    model = load_target(str(target_dir), dtype="float32", placement=Placement(device="cpu"))
    assert file_keys(drafter_dir / WEIGHTS_FILE) == zlab_keys(3)
    drafter = load_drafter(str(drafter_dir), model)
    assert_same_weights(drafter_weights(drafter), load_file(drafter_dir / WEIGHTS_FILE))
    assert drafter.fc.weight.shape == (48, len(drafter.spec.target_layer_ids) * 48)
    assert drafter.block_size == 5


# --- default target layers ----------------------------------------------------------------------------


def test_default_target_layer_ids_known_value():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]


def test_config_without_target_layer_ids_falls_back_to_default():
    raw = tiny_drafter_config(TinyShape()) | {"num_target_layers": 36, "num_hidden_layers": 5}
    raw["dflash_config"] = {"mask_token_id": 32}
    spec = DrafterSpec.from_dict(raw)
    assert spec.target_layer_ids == (1, 9, 17, 25, 33)
    assert list(spec.target_layer_ids) == default_target_layer_ids(36, 5)


def test_load_without_target_layer_ids_uses_default(tiny, good_copy):
    edit_config(good_copy, lambda raw: raw["dflash_config"].pop("target_layer_ids"))
    drafter = load_drafter(str(good_copy), tiny.model)
    expected = default_target_layer_ids(tiny.shape.num_layers, tiny.shape.drafter_layers)
    assert list(drafter.spec.target_layer_ids) == expected


# --- mismatches ---------------------------------------------------------------------------------------


def _set(path: list[str], value):
    def change(raw: dict) -> None:
        node = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


CONFIG_MISMATCHES = {
    # name: (config change, words the message must contain)
    "hidden_size": (_set(["hidden_size"], 64), ["hidden_size", "64", "32"]),
    "target_layer_id_too_large": (
        _set(["dflash_config", "target_layer_ids"], [1, 4]),
        ["target_layer_ids", "4"],
    ),
    "target_layer_id_negative": (_set(["dflash_config", "target_layer_ids"], [-1, 2]), ["target_layer_ids"]),
    "mask_token_id_too_large": (_set(["dflash_config", "mask_token_id"], 33), ["mask_token_id", "33"]),
    "mask_token_id_negative": (_set(["dflash_config", "mask_token_id"], -1), ["mask_token_id"]),
    "num_target_layers": (_set(["num_target_layers"], 5), ["num_target_layers", "5"]),
    "missing_mask_token_id": (lambda raw: raw["dflash_config"].pop("mask_token_id"), ["mask_token_id"]),
    "missing_block_size": (lambda raw: raw.pop("block_size"), ["block_size"]),
    # fields that change the drafter's arithmetic and are not implemented: refused by name, never ignored
    "attention_sink_bias": (_set(["dflash_config", "attention_sink_bias"], True), ["attention_sink_bias"]),
    "swa_sink_bias_top_level": (_set(["add_swa_attention_sink_bias"], True), ["attention_sink_bias"]),
    "no_aux_hidden_state": (_set(["dflash_config", "use_aux_hidden_state"], False), ["use_aux_hidden_state"]),
    "target_hidden_size": (_set(["target_hidden_size"], 64), ["target_hidden_size", "64"]),
    "input_embedding_scale": (_set(["dflash_config", "input_embedding_scale"], 2.0), ["input_embedding_scale"]),
    "output_multiplier": (_set(["output_multiplier"], 0.5), ["output_multiplier"]),
    "logit_softcapping": (_set(["final_logit_softcapping"], 30.0), ["final_logit_softcapping"]),
    "mlp_bias": (_set(["mlp_bias"], True), ["mlp_bias"]),
    "partial_rotary": (_set(["rope_parameters"], {"rope_type": "default", "rope_theta": 1e4,
                                                  "partial_rotary_factor": 0.5}), ["partial_rotary_factor"]),
    "unknown_dflash_field": (_set(["dflash_config", "selector_temperature"], 0.7),
                             ["dflash_config.selector_temperature"]),
    "dflash2_field": (_set(["dflash_config", "selector_top_k"], 16), ["selector_top_k", "DFlash2", "architectures"]),
    "dflash2_architecture": (_set(["architectures"], ["DFlash2DraftModel"]), ["missing field", "conv_kernel_size"]),
    "other_architecture": (_set(["architectures"], ["DSparkDraftModel"]), ["DSparkDraftModel"]),
    "other_model_type": (_set(["model_type"], "llama"), ["model_type", "llama"]),
    "unknown_layer_type": (_set(["layer_types"], ["sliding_attention", "chunked_attention"]), ["layer_types"]),
    "sliding_without_window": (_set(["layer_types"], ["sliding_attention", "full_attention"]), ["window", "layer 0"]),
    "layer_types_count": (_set(["layer_types"], ["full_attention"] * 3), ["layer_types", "2 layers"]),
    "non_bool_causal": (_set(["dflash_config", "causal"], "yes"), ["causal"]),
}


@pytest.mark.parametrize("name", sorted(CONFIG_MISMATCHES))
def test_config_mismatch_refused_naming_field_and_file(tiny, good_copy, name):
    change, words = CONFIG_MISMATCHES[name]
    edit_config(good_copy, change)
    with pytest.raises(CheckpointMismatchError) as info:
        load_drafter(str(good_copy), tiny.model)
    message = str(info.value)
    assert str(good_copy / "config.json") in message
    for word in words:
        assert word in message, (word, message)
    assert isinstance(info.value, BadInputError)


def test_missing_weight_key_refused(tiny, good_copy):
    def drop(weights):
        del weights["layers.1.mlp.down_proj.weight"]

    edit_weights(good_copy, drop)
    with pytest.raises(CheckpointMismatchError) as info:
        load_drafter(str(good_copy), tiny.model)
    message = str(info.value)
    assert "layers.1.mlp.down_proj.weight" in message
    assert str(good_copy) in message


def test_separate_mask_embedding_refused_by_name(tiny, good_copy):
    edit_weights(good_copy, lambda w: w.update({"mask_embedding": torch.zeros(tiny.shape.hidden_size)}))
    with pytest.raises(CheckpointMismatchError, match="mask embedding") as info:
        load_drafter(str(good_copy), tiny.model)
    assert "mask_embedding" in str(info.value) and str(good_copy) in str(info.value)


def test_unexpected_weight_key_refused(tiny, good_copy):
    edit_weights(good_copy, lambda w: w.update({"layers.2.mlp.up_proj.weight": torch.zeros(3, 3)}))
    with pytest.raises(CheckpointMismatchError) as info:
        load_drafter(str(good_copy), tiny.model)
    assert "layers.2.mlp.up_proj.weight" in str(info.value)
    assert str(good_copy) in str(info.value)


def test_wrong_weight_shape_refused(tiny, good_copy):
    key = "layers.0.mlp.up_proj.weight"

    def transpose(weights):
        weights[key] = weights[key].t().contiguous()

    edit_weights(good_copy, transpose)
    with pytest.raises(CheckpointMismatchError) as info:
        load_drafter(str(good_copy), tiny.model)
    message = str(info.value)
    assert key in message
    assert str((tiny.shape.hidden_size, tiny.shape.intermediate_size)) in message  # the wrong shape
    assert str(good_copy) in message


def test_fc_shape_mismatch_with_layer_count_refused(tiny, good_copy):
    """Three taps in config.json but fc trained for two: the shape check catches it."""
    edit_config(good_copy, _set(["dflash_config", "target_layer_ids"], [0, 1, 2]))
    with pytest.raises(CheckpointMismatchError) as info:
        load_drafter(str(good_copy), tiny.model)
    assert "fc.weight" in str(info.value)


def test_missing_config_json_refused(tiny, good_copy):
    (good_copy / "config.json").unlink()
    with pytest.raises(CheckpointMismatchError) as info:
        load_drafter(str(good_copy), tiny.model)
    assert "config.json" in str(info.value)
    assert str(good_copy) in str(info.value)


def test_missing_safetensors_refused(tiny, good_copy):
    (good_copy / WEIGHTS_FILE).unlink()
    with pytest.raises(CheckpointMismatchError) as info:
        load_drafter(str(good_copy), tiny.model)
    assert WEIGHTS_FILE in str(info.value)
    assert str(good_copy) in str(info.value)


def test_malformed_json_refused(tiny, good_copy):
    path = good_copy / "config.json"
    path.write_text(path.read_text()[:-20] + ",,,")
    with pytest.raises(CheckpointMismatchError) as info:
        load_drafter(str(good_copy), tiny.model)
    assert str(path) in str(info.value)


def test_missing_folder_refused(tiny, tmp_path):
    with pytest.raises(CheckpointMismatchError) as info:
        load_drafter(str(tmp_path / "nowhere"), tiny.model)
    assert "nowhere" in str(info.value)


# Malformed checkpoints: each must surface as one CheckpointMismatchError naming the field or file,
# never a raw KeyError / ValueError / SafetensorError / FileNotFoundError / JSONDecodeError.


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads"])
def test_missing_shape_field_refused(tiny, good_copy, field):
    edit_config(good_copy, lambda raw: raw.pop(field))
    with pytest.raises(CheckpointMismatchError, match=field):
        load_drafter(str(good_copy), tiny.model)


def test_non_integer_block_size_refused(tiny, good_copy):
    edit_config(good_copy, _set(["block_size"], "eight"))
    with pytest.raises(CheckpointMismatchError, match="block_size"):
        load_drafter(str(good_copy), tiny.model)


def test_corrupt_safetensors_refused(tiny, good_copy):
    (good_copy / WEIGHTS_FILE).write_bytes(b"this is not a safetensors file")
    with pytest.raises(CheckpointMismatchError, match=WEIGHTS_FILE):
        load_drafter(str(good_copy), tiny.model)


def test_index_with_missing_shard_refused(tiny, good_copy):
    weights = load_file(good_copy / WEIGHTS_FILE)
    (good_copy / WEIGHTS_FILE).unlink()
    shard = "model-00001-of-00001.safetensors"
    (good_copy / WEIGHTS_INDEX_FILE).write_text(json.dumps({"weight_map": {k: shard for k in weights}}))
    with pytest.raises(CheckpointMismatchError, match=shard):
        load_drafter(str(good_copy), tiny.model)


def test_malformed_index_json_refused(tiny, good_copy):
    (good_copy / WEIGHTS_FILE).unlink()
    (good_copy / WEIGHTS_INDEX_FILE).write_text("{not json")
    with pytest.raises(CheckpointMismatchError, match=WEIGHTS_INDEX_FILE):
        load_drafter(str(good_copy), tiny.model)


# --- other weight layouts -----------------------------------------------------------------------------


def test_sharded_checkpoint_loads_same_weights(tiny, good_copy):
    weights = load_file(good_copy / WEIGHTS_FILE)
    keys = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for shard, shard_keys in halves.items():
        save_file({k: weights[k] for k in shard_keys}, good_copy / shard)
        weight_map.update({k: shard for k in shard_keys})
    total = sum(v.numel() * v.element_size() for v in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (good_copy / WEIGHTS_INDEX_FILE).write_text(json.dumps(index))
    (good_copy / WEIGHTS_FILE).unlink()

    drafter = load_drafter(str(good_copy), tiny.model)
    assert_same_weights(drafter_weights(drafter), weights)


def test_model_prefixed_keys_load(tiny, good_copy):
    weights = load_file(good_copy / WEIGHTS_FILE)
    edit_weights(good_copy, lambda w: {f"model.{k}": v for k, v in w.items()})
    assert all(k.startswith("model.") for k in file_keys(good_copy / WEIGHTS_FILE))
    drafter = load_drafter(str(good_copy), tiny.model)
    assert_same_weights(drafter_weights(drafter), weights)


# --- forward: independence from context chunking -------------------------------------------------------


def _inputs(tiny, num_context: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = tiny.shape.hidden_size
    taps = len(tiny.drafter.spec.target_layer_ids)
    context = torch.randn(1, num_context, taps * hidden, generator=generator)
    bonus = int(torch.randint(0, tiny.shape.vocab_size, (1,), generator=generator))
    ids = torch.tensor([[bonus] + [tiny.drafter.spec.mask_token_id] * (tiny.drafter.block_size - 1)])
    block = tiny.model.get_input_embeddings()(ids)
    return block, context


@pytest.mark.parametrize("chunks", [(6, 7), (1, 12), (12, 1), (3, 4, 6), (13, 0)])
def test_forward_independent_of_context_chunking(tiny, chunks):
    drafter = tiny.drafter
    total = sum(chunks)
    with torch.no_grad():
        block, context = _inputs(tiny, total)
        cache = drafter.new_cache(64)
        once = drafter(block, context, cache)
        assert cache.length == total
        assert once.shape == block.shape and once.dtype == torch.float32

        cache = drafter.new_cache(64)
        start = 0
        junk_generator = torch.Generator().manual_seed(99)
        for size in chunks[:-1]:
            junk_block = torch.randn(block.shape, generator=junk_generator)  # its output is thrown away
            drafter(junk_block, context[:, start : start + size], cache)
            start += size
            assert cache.length == start
        chunked = drafter(block, context[:, start:], cache)
        assert cache.length == total
    torch.testing.assert_close(chunked, once, rtol=0, atol=1e-5)


def test_forward_depends_on_context(tiny):
    """Sanity for the test above: a different context changes the block output."""
    drafter = tiny.drafter
    with torch.no_grad():
        block, context = _inputs(tiny, 8)
        first = drafter(block, context, drafter.new_cache(16))
        second = drafter(block, context.flip(1), drafter.new_cache(16))
        third = drafter(block, context[:, :7], drafter.new_cache(16))
    assert (first - second).abs().max() > 1e-3
    assert (first - third).abs().max() > 1e-3


def test_forward_cache_overflow_raises(tiny):
    drafter = tiny.drafter
    with torch.no_grad():
        block, context = _inputs(tiny, 5)
        with pytest.raises(RuntimeError):
            drafter(block, context, drafter.new_cache(4))


def test_target_checkpoint_given_as_drafter_is_named_as_a_target(tiny):
    """The commonest mix-up: the target's folder where the drafter goes. One line saying so, not
    'missing field block_size'."""
    with pytest.raises(CheckpointMismatchError) as info:
        load_drafter(str(tiny.target_dir), tiny.model)
    message = str(info.value)
    assert "is a target model (Qwen3ForCausalLM), not a DFlash drafter" in message
    assert str(tiny.target_dir / "config.json") in message and len(message.splitlines()) == 1
