"""CUDA graphs (GPU only; skipped on CPU machines): replaying captured verify, commit and drafter
passes must give exactly the eager path's tokens, for every engine, on attention-only and hybrid targets
with DFlash and DFlash2 drafters."""

from __future__ import annotations

import copy

import pytest
import torch

from workers.decoding import ar, ddtree, dflash
from workers.decoding.drafting import DraftGraphStore
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import DFlashParams, TreeParams
from workers.decoding.tree import build_tree
from workers.models.runner.target import StaticTarget

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ENGINES = [("ar", ar.generate, None), ("dflash", dflash.generate, DFlashParams()),
           ("ddtree", ddtree.generate, TreeParams(16)), ("ddtree", ddtree.generate, TreeParams(48, branching=2))]


@pytest.mark.parametrize("name", ["tiny", "tiny_small_vocab", "tiny_hybrid", "tiny_hybrid_kernels", "tiny_next",
                                  "tiny_dflash2", "tiny_hybrid_dflash2"])
def test_graph_replay_equals_eager_token_for_token(request, name):
    tiny = request.getfixturevalue(name)
    model = copy.deepcopy(tiny.model).cuda()
    drafter = copy.deepcopy(tiny.drafter).cuda()
    taps = drafter.spec.target_layer_ids
    eager, graphed = StaticTarget(model, taps, graphs=False), StaticTarget(model, taps, graphs=True)
    vocab, accepted = tiny.shape.vocab_size, 0
    for seed in range(4):
        prompt = torch.randint(1, vocab, (1, 5 + 7 * seed), generator=torch.Generator().manual_seed(seed)).cuda()
        config = GenerationConfig(max_new_tokens=40, seed=seed)
        reference = ar.generate(eager, None, prompt, config).token_ids
        for _, engine, params in ENGINES:
            want = engine(eager, drafter if params else None, prompt, config, params)
            got = engine(graphed, drafter if params else None, prompt, config, params)
            assert want.token_ids == reference  # eager on CUDA is itself exact
            assert got.token_ids == want.token_ids  # (acceptance may differ: the drafter graph reads a masked cache)
            accepted += sum(got.acceptance_lengths) - len(got.acceptance_lengths)
    if name != "tiny_next":  # MoE routing cannot be captured: that target falls back to eager, with a warning
        assert graphed.graphs and graphed.verify_graphs.cache and graphed.commit_graphs.graphs, "nothing was captured"
        store = graphed.drafter_graphs  # the drafter's graphs, kept with the target's across generations
        assert store is not None and store._drafting.graphs, "the drafter pass was never captured"
    assert accepted > 0


@pytest.mark.parametrize("chunk", [5, 256])
@pytest.mark.parametrize("name", ["tiny", "tiny_small_vocab", "tiny_next"])
def test_drafter_graph_logits_equal_eager_past_the_window(request, name, chunk):
    """The drafter's replayed pass (whole cache under each layer's mask) gives the eager pass's logits
    (each sliding layer reading only its window's slots) for full, sliding + full and all-sliding
    drafters, as the context grows past the window; over two generations, whose prompts are written
    ahead by the write graph in chunks of ``chunk`` rows (overlapping, or one with padding)."""
    from workers.decoding.drafting import EagerDrafting, GraphDrafting

    tiny = request.getfixturevalue(name)
    model, drafter = copy.deepcopy(tiny.model).cuda(), copy.deepcopy(tiny.drafter).cuda()
    target = StaticTarget(model, drafter.spec.target_layer_ids, graphs=True)
    eager, graphed = EagerDrafting(drafter, target, 256), GraphDrafting(drafter, target, 256, chunk=chunk)
    generator = torch.Generator().manual_seed(0)
    taps = torch.randn(1, 80, drafter.fc.in_features, generator=generator).cuda()
    bonus = torch.randint(1, tiny.shape.vocab_size, (12,), generator=generator).cuda()
    block = drafter.block_size
    for prompt in (20, 27):  # two generations, reusing the graphs
        eager.cache.reset()
        graphed.cache.reset()
        fed = 0
        for index, new in enumerate((prompt, 1, block, 3, 2, block, 1, 4)):  # a prompt, then rounds
            context = taps[:, fed : fed + new]
            want = eager.draft(bonus[index : index + 1], context, block - 1)
            got = graphed.draft(bonus[index : index + 1], context, block - 1)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            fed += new
        assert fed > max(a.window or 0 for a in drafter.spec.layer_attention)
    assert graphed.graphs, "the drafter pass was never replayed from a graph"
    assert graphed.write_graph is not None, "the prompt was never written ahead by the write graph"


@pytest.mark.parametrize("name", ["tiny", "tiny_small_vocab"])
def test_counted_drafter_graph_equals_eager_counted_and_plain_passes(request, name):
    """The round's form of a draft (the new context's length a device scalar over a block of context
    rows, queued before the host read) replayed from a graph gives the eager counted pass's logits,
    and both the plain eager pass's, round after round past the window."""
    from workers.decoding.drafting import EagerDrafting

    tiny = request.getfixturevalue(name)
    model, drafter = copy.deepcopy(tiny.model).cuda(), copy.deepcopy(tiny.drafter).cuda()
    target = StaticTarget(model, drafter.spec.target_layer_ids, graphs=True)
    plain, eager = EagerDrafting(drafter, target, 256), EagerDrafting(drafter, target, 256)
    graphed = DraftGraphStore().open(drafter, target, 256)
    generator = torch.Generator().manual_seed(1)
    block = drafter.block_size
    taps = torch.randn(1, 80, drafter.fc.in_features, generator=generator).cuda()
    bonus = torch.randint(1, tiny.shape.vocab_size, (12,), generator=generator).cuda()
    fed = 20
    for drafting in (plain, eager, graphed):
        drafting.draft(bonus[:1], taps[:, :fed], block - 1)  # the prompt
    for index, new in enumerate((1, block, 3, 2, block, 1, 4), 1):
        rows = torch.randn(1, block, taps.shape[2], generator=generator).cuda()  # padding: anything finite
        rows[:, :new] = taps[:, fed : fed + new]
        count = torch.tensor(new, device="cuda")
        want = plain.draft(bonus[index : index + 1], taps[:, fed : fed + new], block - 1)
        counted = eager.draft_counted(bonus[index : index + 1], rows, count, block - 1)
        got = graphed.draft_counted(bonus[index : index + 1], rows, count, block - 1)
        for drafting in (eager, graphed):
            drafting.advance(new)
        torch.testing.assert_close(got, counted, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(counted, want, atol=1e-4, rtol=1e-4)
        fed += new
    assert fed > max(a.window or 0 for a in drafter.spec.layer_attention)
    assert plain.cache.length == eager.cache.length == graphed.cache.length == fed


@pytest.mark.parametrize("seed", range(6))
def test_tree_built_on_the_gpu_equals_the_cpu_tree(seed):
    """build_tree runs where the drafter's logits are: the GPU's sorts must give the CPU's tree,
    exact ties of path sums included (each row a permutation of 0, -1, -2, ...: distinct tokens
    per row, so torch.topk's order is defined, but many equal sums across rows)."""
    generator = torch.Generator().manual_seed(seed)
    log_probs = torch.log_softmax(torch.randn(15, 3000, generator=generator) * 3, dim=-1)
    if seed % 2:
        log_probs = -torch.stack([torch.randperm(3000, generator=generator) for _ in range(15)]).float()
    for params in (TreeParams(16), TreeParams(300, max_depth=7), TreeParams(1024, branching=8)):
        cpu, gpu = build_tree(log_probs, params), build_tree(log_probs.cuda(), params)
        for name in ("tokens", "depths", "parents", "visibility", "log_probs"):
            assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu()), (name, params)


def test_replayed_tree_build_equals_the_eager_build(tiny):
    """GraphDrafting.build_tree replays one captured graph per tree knobs: every replay must give
    build_tree's tree for the new logits (not the captured call's)."""
    model = copy.deepcopy(tiny.model).cuda()
    drafter = copy.deepcopy(tiny.drafter).cuda()
    target = StaticTarget(model, drafter.spec.target_layer_ids, graphs=True)
    graphs = DraftGraphStore().open(drafter, target, 64)
    generator = torch.Generator().manual_seed(0)
    for params in (TreeParams(16), TreeParams(40, max_depth=5, branching=3)):
        for _ in range(3):
            logits = (torch.randn(15, 300, generator=generator) * 3).cuda()
            want = build_tree(torch.log_softmax(logits, dim=-1), params)
            got = graphs.build_tree(logits, params)
            for name in ("tokens", "depths", "parents", "visibility", "log_probs"):
                assert torch.equal(getattr(want, name), getattr(got, name)), (name, params)


@pytest.mark.parametrize("segments", [1, 2])
@pytest.mark.parametrize("name", ["tiny_hybrid", "tiny_hybrid_kernels", "tiny"])
@torch.inference_mode()  # as the engines run the target
def test_prompt_chunks_replayed_from_a_graph_equal_eager(request, name, segments):
    """Full prompt chunks replay one captured pass (two segments: one graph per segment; the warm-ups
    must not advance the GDN state); the logits, the taps and the tokens generated after it (AR's
    one-token advances replay their own graph) equal the eager prompt's."""
    tiny = request.getfixturevalue(name)
    model = copy.deepcopy(tiny.model).cuda()
    taps = tiny.drafter.spec.target_layer_ids
    starts = (len(model.model.layers) // 2,) if segments == 2 else ()
    prompt = torch.randint(1, tiny.shape.vocab_size, (1, 29), generator=torch.Generator().manual_seed(3)).cuda()
    outputs = []
    for graphs in (False, True):
        target = StaticTarget(model, taps, prefill_chunk=8, graphs=graphs, segment_starts=starts)
        assert len(target.segments) == segments
        for _ in range(2):  # the second prompt replays the graph captured during the first
            target.start(capacity=128, max_verify=16)
            opening = target.prefill(prompt)
            tokens = ar.generate(target, None, prompt, GenerationConfig(max_new_tokens=12)).token_ids
        outputs.append((opening.logits, opening.taps, tokens))
        if graphs:
            prefill_graph = target.advance_graphs.graphs.get(target.prefill_chunk)
            assert prefill_graph is not None and 1 in target.advance_graphs  # AR's rounds: width 1
            assert (type(prefill_graph[0]).__name__ == "_Steps") == (segments == 2)
    (logits, taps_eager, tokens), (logits_g, taps_g, tokens_g) = outputs
    torch.testing.assert_close(logits_g, logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(taps_g, taps_eager, atol=1e-5, rtol=1e-5)
    assert tokens == tokens_g


@pytest.mark.parametrize("name", ["tiny_hybrid", "tiny_hybrid_kernels", "tiny"])
def test_two_segment_graphs_on_one_gpu_equal_the_unsplit_target(request, name):
    """A target in two segments of layers replays one graph per segment and width, the hidden state
    handed between them; every engine's tokens equal the unsplit eager run's, and a tree pass's logits
    the unsplit graph's."""
    tiny = request.getfixturevalue(name)
    model = copy.deepcopy(tiny.model).cuda()
    drafter = copy.deepcopy(tiny.drafter).cuda()
    taps = drafter.spec.target_layer_ids
    eager = StaticTarget(model, taps, graphs=False)
    whole = StaticTarget(model, taps, graphs=True)
    split = StaticTarget(model, taps, graphs=True, segment_starts=(len(model.model.layers) // 2,))
    assert len(split.segments) == 2
    vocab = tiny.shape.vocab_size
    for seed in range(2):
        prompt = torch.randint(1, vocab, (1, 6 + 9 * seed), generator=torch.Generator().manual_seed(seed)).cuda()
        config = GenerationConfig(max_new_tokens=32, seed=seed)
        for _, engine, params in ENGINES:
            want = engine(eager, drafter if params else None, prompt, config, params)
            got = engine(split, drafter if params else None, prompt, config, params)
            assert got.token_ids == want.token_ids
    verify = split.verify_graphs.cache
    assert verify and all(type(verify[key][0]).__name__ == "_Steps" for key in verify.keys())
    log_probs = torch.log_softmax(torch.randn(7, vocab, generator=torch.Generator().manual_seed(9)) * 2, dim=-1)
    tree = build_tree(log_probs, TreeParams(24)).to(torch.device("cuda"))
    outputs = []
    with torch.inference_mode():
        for target in (whole, split):
            target.start(capacity=128, max_verify=32)
            target.prefill(prompt)
            out = target.verify_tree(prompt[0, -1], tree)
            outputs.append((out.logits.clone(), out.taps.clone()))
    torch.testing.assert_close(outputs[1][0], outputs[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs[1][1], outputs[0][1], atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_a_target_over_cuda_and_the_cpu_runs_eagerly_and_matches(tiny_hybrid):
    """Half the layers (and the head) on the CPU: eager segments hand the hidden state across devices."""
    model = copy.deepcopy(tiny_hybrid.model).cuda()
    half = len(model.model.layers) // 2
    reference = StaticTarget(copy.deepcopy(model), graphs=False)
    for layer in model.model.layers[half:]:
        layer.cpu()
    model.model.norm.cpu()
    model.lm_head.cpu()
    split = StaticTarget(model, graphs=False)
    assert len(split.segments) == 2
    prompt = torch.randint(1, 6, (1, 11), generator=torch.Generator().manual_seed(2)).cuda()
    tree = build_tree(torch.log_softmax(torch.randn(5, 6, generator=torch.Generator().manual_seed(1)), -1),
                      TreeParams(12))
    outputs = []
    for target in (reference, split):
        target.start(capacity=64, max_verify=16)
        target.prefill(prompt)
        outputs.append(target.verify_tree(prompt[0, -1], tree.to(torch.device("cuda"))).logits.float().cpu())
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["tiny_hybrid", "tiny_hybrid_kernels", "tiny_next"])
def test_a_commit_on_parallel_streams_equals_one_on_one_stream(request, name, monkeypatch):
    """The commit's pieces on three streams (parallel branches once captured in a graph) leave every
    GDN state, conv window and K/V slot bit-equal to the commit on one stream, whether run eagerly
    (the first of each path length, and the MoE target's, which runs eagerly throughout) or replayed;
    and the engines' tokens are the same."""
    from workers.models.runner import loop

    tiny = request.getfixturevalue(name)
    model = copy.deepcopy(tiny.model).cuda()
    drafter = copy.deepcopy(tiny.drafter).cuda()
    taps = drafter.spec.target_layer_ids
    vocab = tiny.shape.vocab_size
    prompt = torch.randint(1, vocab, (1, 13), generator=torch.Generator().manual_seed(3)).cuda()
    log_probs = torch.log_softmax(torch.randn(7, vocab, generator=torch.Generator().manual_seed(5)) * 2, dim=-1)
    tree = build_tree(log_probs, TreeParams(24)).to(torch.device("cuda"))
    deepest = int(tree.depths.argmax()) + 1  # node indices count the root as 0
    paths = [torch.nonzero(tree.visibility[node])[:, 0] for node in (deepest, tree.parents[deepest], 0)]
    assert [p.shape[0] for p in paths] == [int(tree.depths.max()) + 1, int(tree.depths.max()), 1]
    targets = {branches: StaticTarget(model, taps, graphs=True) for branches in (1, 3)}
    for branches, target in targets.items():
        monkeypatch.setattr(loop, "COMMIT_BRANCHES", branches)
        with torch.inference_mode():
            target.start(capacity=160, max_verify=32)
            target.prefill(prompt)
            for path in paths * 3:  # each length: run eagerly and captured, then replayed twice
                target.verify_tree(prompt[0, -1], tree)
                target.commit(path)
        torch.cuda.synchronize()
    one, three = (targets[b].state for b in (1, 3))
    assert one.length == three.length and len(one.states) >= 2
    for i in one.states:
        assert torch.equal(three.states[i], one.states[i]) and torch.equal(three.conv_windows[i], one.conv_windows[i])
    for mine, theirs in zip(three.kv.stacks, one.kv.stacks, strict=True):
        assert torch.equal(mine[:, :, :, :, : one.length], theirs[:, :, :, :, : one.length])  # the committed slots
    if name != "tiny_next":  # MoE routing cannot be captured: that target runs eagerly
        assert targets[3].commit_graphs.graphs, "no commit was captured"
    config = GenerationConfig(max_new_tokens=24, seed=1)
    for _, engine, params in ENGINES[1:]:
        tokens = {}
        for branches, target in targets.items():
            monkeypatch.setattr(loop, "COMMIT_BRANCHES", branches)
            tokens[branches] = engine(target, drafter, prompt, config, params).token_ids
        assert tokens[3] == tokens[1]


@pytest.mark.parametrize("name", ["tiny", "tiny_hybrid", "tiny_hybrid_kernels", "tiny_hybrid_dflash2"])
def test_the_commit_beside_the_next_draft_changes_nothing(request, name, monkeypatch):
    """Each round's commit on a side stream beside the next draft (and its pieces on three streams) gives
    the same tokens, the same acceptance and the same committed state as the commit in line after it."""
    from workers.decoding import generation
    from workers.models.runner import loop

    tiny = request.getfixturevalue(name)
    model = copy.deepcopy(tiny.model).cuda()
    drafter = copy.deepcopy(tiny.drafter).cuda()
    taps = drafter.spec.target_layer_ids
    targets = {False: StaticTarget(model, taps, graphs=True), True: StaticTarget(model, taps, graphs=True)}
    vocab = tiny.shape.vocab_size
    for seed in range(3):
        prompt = torch.randint(1, vocab, (1, 6 + 5 * seed), generator=torch.Generator().manual_seed(seed)).cuda()
        config = GenerationConfig(max_new_tokens=32, seed=seed)
        for _, engine, params in ENGINES[1:]:
            outputs = {}
            for beside, target in targets.items():
                monkeypatch.setattr(generation, "COMMIT_BESIDE_DRAFT", beside)
                monkeypatch.setattr(loop, "COMMIT_BRANCHES", 3 if beside else 1)
                outputs[beside] = engine(target, drafter, prompt, config, params)
            assert outputs[True].token_ids == outputs[False].token_ids
            assert outputs[True].acceptance_lengths == outputs[False].acceptance_lengths
            line, apart = targets[False].state, targets[True].state
            assert line.length == apart.length
            for i in line.states:
                assert torch.equal(apart.states[i], line.states[i])
            for mine, theirs in zip(apart.kv.stacks, line.kv.stacks, strict=True):
                assert torch.equal(mine[:, :, :, :, : line.length], theirs[:, :, :, :, : line.length])


@pytest.mark.parametrize("form", ["replay", "chunk"])
def test_greedy_decoding_through_the_gdn_kernels_equals_ar(tiny_hybrid_kernels, form, monkeypatch):
    """On a hybrid whose GDN layers run the Triton kernels (heads of 16), with either commit form
    (``gdn_triton.COMMIT_FORM``), eager and graphed, DFlash and DDTree give AR's tokens, and commits of
    more than one token ran in that form."""
    from workers.models import gdn_triton

    monkeypatch.setattr(gdn_triton, "COMMIT_FORM", form)
    launches = []
    name = "_commit_chunk_kernel" if form == "chunk" else "_commit_kernel"
    kernel = getattr(gdn_triton, name)

    class Counted:  # the kernel as before, its launches counted
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(args[1].shape[0])  # the path's length
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(gdn_triton, name, Counted())
    tiny = tiny_hybrid_kernels
    model = copy.deepcopy(tiny.model).cuda()
    drafter = copy.deepcopy(tiny.drafter).cuda()
    taps = drafter.spec.target_layer_ids
    eager, graphed = StaticTarget(model, taps, graphs=False), StaticTarget(model, taps, graphs=True)
    assert all(layer.kernels for target in (eager, graphed) for layer in target.loop.gdn.values())
    launches.clear()  # a GDN layer's warm-up compile commits every length on zeros; count the rounds' own
    vocab, accepted = tiny.shape.vocab_size, 0
    for seed in range(4):
        prompt = torch.randint(1, vocab, (1, 5 + 7 * seed), generator=torch.Generator().manual_seed(seed)).cuda()
        config = GenerationConfig(max_new_tokens=40, seed=seed)
        reference = ar.generate(eager, None, prompt, config).token_ids
        for _, engine, params in ENGINES[1:]:
            for target in (eager, graphed):
                out = engine(target, drafter, prompt, config, params)
                assert out.token_ids == reference
                accepted += sum(out.acceptance_lengths) - len(out.acceptance_lengths)
    assert accepted > 0 and max(launches, default=0) > 1, f"no commit of more than one token ran in {form} form"
