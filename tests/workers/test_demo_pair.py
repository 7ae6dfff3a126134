"""``python -m tools.demo_pair``: the demo pair's training path on a tiny slice of the standard
library (the QUICK recipe, seconds), loaded back through the project's own loading code; the
drafter's block-parallel training forward against its decoding forward; the cache key; and the pair
the repository ships (``data/demo_pair``, what ``make demo`` runs): its recipe and its acceptance."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tools.demo_pair import (
    HELD_OUT,
    QUICK,
    SHIPPED,
    DemoRecipe,
    build,
    is_current,
    main,
    read_recipe,
    stdlib_files,
)
from tools.drafter_training import block_hidden
from workers.decoding import ar, ddtree, dflash
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import DFlashParams, TreeParams
from workers.metrics import summarize
from workers.models.facts import load_tokenizer
from workers.models.loading import Placement, load_drafter, load_target
from workers.models.runner.target import make_target
from workers.prompts import ChatFormat, encode, load_prompts, stop_token_ids

# the quick recipe, smaller still: a few seconds of training on two CPU threads
TEST_RECIPE = replace(QUICK, corpus_bytes=100_000, target_steps=8, data_sequences=4, drafter_steps=8)
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread is as fast, a core stays free


@pytest.fixture(scope="module")
def pair(tmp_path_factory, one_torch_thread):
    folder = tmp_path_factory.mktemp("demo") / "pair"
    build(folder, TEST_RECIPE)
    return folder


def test_held_out_modules_are_never_trained_on():
    train, held = stdlib_files()
    assert held and len(train) > 50
    assert {p.name for p in held} <= set(HELD_OUT)
    assert not {p.resolve() for p in train} & {p.resolve() for p in held}
    assert not any(part in ("site-packages", "test", "tests") for p in train for part in p.parts[-3:-1])


def test_pair_loads_through_the_project_loaders_and_greedy_ddtree_equals_ar(pair):
    assert sorted(p.name for p in pair.iterdir()) == ["drafter", "prompts.jsonl", "recipe.json", "target"]
    assert model_dtypes(pair) == {torch.float16}  # the shipped layout: float16 on disk
    model = load_target(str(pair / "target"), dtype="float32", placement=Placement(device="cpu"))
    tokenizer = load_tokenizer(str(pair / "target"))
    assert tokenizer is not None and model.config.model_type == "qwen3"
    code = "def f(x):\n    return x + 1\n"
    assert tokenizer.decode(tokenizer(code)["input_ids"]) == code  # byte-level: lossless round trip
    drafter = load_drafter(str(pair / "drafter"), model)
    assert drafter.block_size == TEST_RECIPE.block_size
    assert drafter.spec.mask_token_id == tokenizer.convert_tokens_to_ids("<|mask|>")

    prompts = load_prompts(pair / "prompts.jsonl")
    assert len(prompts) >= 8 and all(p.text and p.category == "code" for p in prompts)
    rows = model.get_input_embeddings().weight.shape[0]
    target = make_target(model, drafter.spec.target_layer_ids)
    config = GenerationConfig(24, stop_token_ids=stop_token_ids(tokenizer, model.config))
    for prompt in prompts[:2]:
        ids = torch.tensor([encode(prompt, tokenizer, rows, ChatFormat(chat_template=False))])
        reference = ar.generate(target, None, ids, config).token_ids
        assert len(reference) > 0
        for params in (TreeParams(16), TreeParams(4, 3, 2)):
            assert ddtree.generate(target, drafter, ids, config, params).token_ids == reference
        assert dflash.generate(target, drafter, ids, config, DFlashParams()).token_ids == reference


def test_training_forward_matches_the_decoding_forward(pair):
    """block_hidden (all of a sequence's blocks in one pass) gives what DFlashDrafter.forward gives
    for each block alone: training and decoding see the same context and the same block."""
    model = load_target(str(pair / "target"), dtype="float32", placement=Placement(device="cpu"))
    drafter = load_drafter(str(pair / "drafter"), model)
    b, width = drafter.block_size, len(drafter.spec.target_layer_ids) * model.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    taps = torch.randn(40, width, generator=generator)
    tokens = torch.randint(0, model.config.vocab_size - 2, (40,), generator=generator)
    anchors = torch.tensor([5, 17, 30])
    block_ids = torch.full((3, b), drafter.spec.mask_token_id)
    block_ids[:, 0] = tokens[anchors]
    with torch.no_grad():
        embeds = model.get_input_embeddings()(block_ids)
        together = block_hidden(drafter, embeds, taps, anchors)
        for i, anchor in enumerate(anchors.tolist()):
            alone = drafter(embeds[i : i + 1], taps[None, :anchor], drafter.new_cache(anchor + b))
            torch.testing.assert_close(together[i], alone[0], rtol=1e-4, atol=1e-5)


def test_an_up_to_date_folder_is_kept_and_a_changed_recipe_is_not(pair, capsys, monkeypatch):
    assert is_current(pair, TEST_RECIPE)
    assert not is_current(pair, replace(TEST_RECIPE, drafter_steps=9))
    assert not is_current(pair, DemoRecipe())
    monkeypatch.setattr("tools.demo_pair.QUICK", TEST_RECIPE)
    mtime = (pair / "recipe.json").stat().st_mtime_ns
    assert main([str(pair), "--quick"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert (pair / "recipe.json").stat().st_mtime_ns == mtime
    assert json.loads((pair / "recipe.json").read_text())["drafter_steps"] == TEST_RECIPE.drafter_steps


def test_the_recipe_key_leaves_out_what_built_the_pair(pair, tmp_path):
    """recipe.json records the Python, torch and threads of the build as information: a pair built
    elsewhere is still current (the shipped pair serves every Python), a changed recipe field is not."""
    recorded = json.loads((pair / "recipe.json").read_text())
    assert set(recorded["built_with"]) >= {"python", "torch", "threads"}
    assert "python" not in TEST_RECIPE.key()
    recorded["built_with"] = {"python": "3.0.0", "torch": "0.1", "threads": 64}
    (tmp_path / "recipe.json").write_text(json.dumps(recorded))
    assert is_current(tmp_path, TEST_RECIPE)
    recorded["seed"] = 1
    (tmp_path / "recipe.json").write_text(json.dumps(recorded))
    assert not is_current(tmp_path, TEST_RECIPE)


def model_dtypes(folder) -> set[torch.dtype]:
    from safetensors.torch import load_file

    return {t.dtype for name in ("target", "drafter") for t in load_file(folder / name / "model.safetensors").values()}


# held-out acceptance of the shipped pair as the demo sweep measures it (its first 8 prompts, 32 tokens)
SHIPPED_PROMPTS, SHIPPED_TOKENS = 8, 32


def test_the_shipped_pair_is_the_recipe_and_drafts_tau_3_at_budget_64():
    """data/demo_pair is what DemoRecipe() builds (its recipe.json, float16 weights) and its drafter
    is worth a demo: greedy DDTree at budget 64 commits >= 3 tokens a round on the held-out prompts
    the demo sweeps, with every output equal to AR's."""
    assert read_recipe(SHIPPED) == json.loads(json.dumps(DemoRecipe().key())), (
        "data/demo_pair was not built with DemoRecipe(): rebuild it (python -m tools.demo_pair data/demo_pair "
        "--force --threads 1) after changing the recipe")
    assert model_dtypes(SHIPPED) == {torch.float16}
    model = load_target(str(SHIPPED / "target"), dtype="float32", placement=Placement(device="cpu"))
    tokenizer = load_tokenizer(str(SHIPPED / "target"))
    drafter = load_drafter(str(SHIPPED / "drafter"), model)
    assert drafter.block_size == DemoRecipe().block_size
    target = make_target(model, drafter.spec.target_layer_ids)
    rows = model.get_input_embeddings().weight.shape[0]
    prompts = load_prompts(SHIPPED / "prompts.jsonl")
    assert len(prompts) == 2 * len(HELD_OUT)
    config = GenerationConfig(SHIPPED_TOKENS, stop_token_ids=stop_token_ids(tokenizer, model.config))
    ids = [torch.tensor([encode(p, tokenizer, rows, ChatFormat(chat_template=False))])
           for p in prompts[:SHIPPED_PROMPTS]]
    reference = [ar.generate(target, None, x, config) for x in ids]
    tree = [ddtree.generate(target, drafter, x, config, TreeParams(64)) for x in ids]
    metrics = summarize(tree, reference)
    assert metrics["lossless_match"] == 1.0
    assert metrics["tau"] >= 3.0, f"tau {metrics['tau']:.2f} at budget 64 on {len(ids)} held-out prompts"
