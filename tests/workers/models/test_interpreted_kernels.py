"""The Triton kernels (hybrid layers, DDTree's tree build) against their torch forms, through Triton's interpreter.

The GPU-marked tests are the proof on hardware. These run the same kernels' Python on CPU tensors, in
float32 and float16 (the interpreter has no bfloat16), at small head sizes, so that every CI run checks
the kernels' arithmetic. They need ``triton`` and ``TRITON_INTERPRET=1`` set before it is imported:
``make test-kernels`` installs one and runs them. Elsewhere they are skipped.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch import nn

from tests.helpers.kernel_inputs import attention_pass_inputs, deep_tree_parents, random_tree_parents

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton and TRITON_INTERPRET=1 (make test-kernels)")


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.fixture(autouse=True, scope="module")
def interpreter_reads_one_element_bounds():
    """Triton 3.6's interpreter turns a loop bound loaded from memory into an int with int(array), which
    numpy >= 2.4 refuses for a one-element array of one dimension (the attention and commit kernels
    loop up to a loaded slot); read the element instead, inside the interpreter's own patch scope."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch
    yield
    interpreter._patch_lang_tensor = original


@pytest.mark.parametrize("blocks", [1, 2])
@pytest.mark.parametrize(("q", "depth", "dk", "dv"), [(1, 1, 16, 16), (17, 15, 32, 32), (33, 4, 32, 32),
                                                     (70, 15, 32, 16), (300, 6, 16, 32), (40, "deep", 32, 32)])
def test_the_tree_kernel_equals_the_torch_tree_form(q, depth, dk, dv, blocks, monkeypatch):
    """tree_outputs (the blocked solve with its state products), without and with the gated norm in its
    epilogue, against the per-node torch form, with one block a program and with blocks in pairs (odd
    counts at 1, 17, 40, 70 and 300 nodes); at 17 and 33 nodes the root is apart from the blocks, with a
    program of its own. The deep case has 16-node paths, aligned keys and slow decay, so that every factor
    of the solve's nilpotent product weighs in."""
    from workers.models import gdn_triton
    from workers.models.gdn import ancestor_table, l2_normalize, tree_delta_rule
    from workers.models.gdn_triton import gated_norm, tree_outputs

    monkeypatch.setattr(gdn_triton, "TREE_FORM", (32, 3, blocks))
    g = torch.Generator().manual_seed(q)
    hk, h = 2, 6
    deep = depth == "deep"
    parents = deep_tree_parents(q, g) if deep else random_tree_parents(q, depth, g)
    query, key = torch.randn(q, hk, dk, generator=g), torch.randn(q, hk, dk, generator=g) + 3 * deep
    value, log_gate = torch.randn(q, h, dv, generator=g), -torch.rand(q, h, generator=g) * (0.05 if deep else 2)
    beta, state = torch.rand(q, h, generator=g), torch.randn(h, dk, dv, generator=g) * 0.3
    ancestors = ancestor_table(parents)
    want = tree_delta_rule(query, key, value, log_gate, beta, state, ancestors, use_triton=False)
    kq = torch.stack((l2_normalize(key).transpose(0, 1), (l2_normalize(query) * dk**-0.5).transpose(0, 1)), 1)
    v_ = value.transpose(0, 1).contiguous()
    assert relative(tree_outputs(kq, v_, log_gate, beta, state, ancestors), want) < 1e-5
    z = torch.randn(q, h * dv + 5, generator=g)[:, 2 : 2 + h * dv]  # rows strided, as the projection gives them
    weight = 1 + 0.1 * torch.randn(dv, generator=g)
    normed = tree_outputs(kq, v_, log_gate, beta, state, ancestors, norm=(z, weight, 1e-6))
    assert relative(normed, gated_norm(want, z, weight, 1e-6, torch.float32)) < 1e-5


@pytest.mark.parametrize("q", [17, 33])
@torch.inference_mode()
def test_the_roots_program_gives_the_same_bits_in_every_form(q, monkeypatch):
    """The root apart (17 and 33 nodes) has a program that sums over dk in its own steps (``ROOT_STEP``), so a
    form's step does not change its bits: on an H100 a step of 64 changed the last place of most of the
    root's float32 outputs where the blocks' products gave the same bits (twenty-ninth session). Its row
    is the same bits in every form (dk = 128: the forms' steps differ), and the output is the torch form's."""
    from workers.models import gdn_triton
    from workers.models.gdn import ancestor_table, l2_normalize, tree_delta_rule
    from workers.models.gdn_triton import tree_outputs

    g = torch.Generator().manual_seed(5)
    hk, h, dk, dv = 1, 2, 128, 32
    parents = random_tree_parents(q, 15, g)
    query, key = torch.randn(q, hk, dk, generator=g), torch.randn(q, hk, dk, generator=g)
    value, log_gate = torch.randn(q, h, dv, generator=g), -torch.rand(q, h, generator=g) * 2
    beta, state = torch.rand(q, h, generator=g), torch.randn(h, dk, dv, generator=g) * 0.3
    ancestors = ancestor_table(parents)
    kq = torch.stack((l2_normalize(key).transpose(0, 1), (l2_normalize(query) * dk**-0.5).transpose(0, 1)), 1)
    v_ = value.transpose(0, 1).contiguous()
    by_form = [tree_outputs(kq, v_, log_gate, beta, state, ancestors, form=form)
               for form in gdn_triton.FORM_CHOICES + gdn_triton.PAIRED_FORMS]
    assert {form[0] for form in gdn_triton.FORM_CHOICES} == {32, 64}
    assert all(torch.equal(out[0], by_form[0][0]) for out in by_form[1:])
    want = tree_delta_rule(query, key, value, log_gate, beta, state, ancestors, use_triton=False)
    assert relative(by_form[0], want) < 1e-5


def halving_clock(calls: list, device: torch.device) -> list[float]:
    """``lt_product.time_calls`` for the trials' tests: runs each call, and times each at half the one before
    (the interpreter's times say nothing of a GPU's, and their order drifts with the host's load)."""
    assert device.type == "cpu"
    return [(call(), 0.5**i)[1] for i, call in enumerate(calls)]


@torch.inference_mode()
def test_the_tree_kernels_form_is_chosen_once_per_pass_shape(monkeypatch):
    """``TREE_FORM`` None: a tree-pass shape first met inside ``lt_product.choosing()`` runs each of
    FORM_CHOICES on its own inputs and keeps another than the first only where it is FORM_MARGIN faster; a
    form whose bits differ is refused with a warning, as is one that fails; a shape first met outside
    ``choosing()`` keeps the first, untimed. Later calls run the kept form, and every form gives the outputs
    of the form named. The trial runs on ``halving_clock``: the margin alone decides (the last form takes
    a quarter of the first's time)."""
    from workers.models import gdn_triton, lt_product
    from workers.models.gdn import ancestor_table, l2_normalize
    from workers.models.gdn_triton import tree_outputs

    monkeypatch.setattr(gdn_triton, "TREE_FORM", None)
    monkeypatch.setattr(lt_product, "time_calls", halving_clock)
    g = torch.Generator().manual_seed(5)
    q, hk, h, d = 17, 2, 4, 16
    ancestors = ancestor_table(random_tree_parents(q, 6, g))
    kq = torch.stack((l2_normalize(torch.randn(hk, q, d, generator=g)),
                      l2_normalize(torch.randn(hk, q, d, generator=g)) * d**-0.5), 1)
    v_, state = torch.randn(h, q, d, generator=g), torch.randn(h, d, d, generator=g) * 0.3
    log_gate, beta = -torch.rand(q, h, generator=g), torch.rand(q, h, generator=g)

    def solve(form=None):
        return tree_outputs(kq, v_, log_gate, beta, state, ancestors, form=form)

    forms = gdn_triton.FORM_CHOICES
    named = solve(forms[0])
    for margin, kept in ((0.4, forms[-1]), (0.95, forms[0])):
        monkeypatch.setattr(gdn_triton, "_FORMS", {})
        monkeypatch.setattr(gdn_triton, "_FORM_TRIALS", {})
        monkeypatch.setattr(gdn_triton, "FORM_MARGIN", margin)
        with lt_product.choosing():
            assert torch.equal(solve(), named)
        assert torch.equal(solve(), named) and list(gdn_triton._FORMS.values()) == [kept]
        [line] = gdn_triton.forms_report()
        assert f"{q} nodes, {h} heads" in line and line.endswith(f"-> {gdn_triton.form_name(kept)}")
        assert all(f"{gdn_triton.form_name(form)} " in line for form in forms)

    monkeypatch.setattr(gdn_triton, "_FORMS", {})
    monkeypatch.setattr(gdn_triton, "_FORM_TRIALS", {})
    assert torch.equal(solve(), named) and gdn_triton.forms_report() == []  # first met outside: no trial
    assert list(gdn_triton._FORMS.values()) == [forms[0]]

    # a form whose bits differ from the first's is never taken, even where any other would be
    monkeypatch.setattr(gdn_triton, "FORM_MARGIN", -100.0)

    def launch(form):
        return named + (form != forms[0])

    with lt_product.choosing(), pytest.warns(UserWarning, match="other bits"):
        assert gdn_triton.chosen_form(("other",), launch, torch.device("cpu")) == forms[0]

    # nor one that fails (say, past the GPU's shared memory)
    def failing(form):
        if form != forms[0]:
            raise RuntimeError("out of resources")
        return named

    with lt_product.choosing(), pytest.warns(UserWarning, match="failed in form"):
        assert gdn_triton.chosen_form(("failing",), failing, torch.device("cpu")) == forms[0]


def attention_case(heads, groups, q, capacity, length, dim, causal):
    """A pass's float16 attention inputs on the CPU (``attention_pass_inputs`` with each node's ends), and
    float32 attention over exactly its visible keys: [Hkv, g*q, D] and in o_proj's layout [q, Hq*D] (each
    node's query heads side by side)."""
    from workers.models.attention import attend_folded

    inputs = attention_pass_inputs(heads, groups, q, capacity, length, dim, torch.float16, q, "cpu", causal, ends=True)
    query, key, value, mask = inputs[:4]
    end = length + q
    want = attend_folded(query.float(), key[:, :end].float(), value[:, :end].float(), mask[:, :end].float(),
                         dim**-0.5)
    return inputs, want, want.reshape(heads * groups, q, dim).transpose(0, 1).reshape(q, heads * groups * dim)


@pytest.mark.parametrize(("heads", "groups", "q", "capacity", "length", "dim", "causal"),
                         [(2, 3, 30, 200, 100, 32, False), (1, 4, 129, 1300, 1024, 32, False),
                          (2, 1, 257, 700, 0, 16, False), (2, 2, 1, 300, 200, 32, False),
                          (1, 2, 160, 300, 0, 32, True)])
@pytest.mark.parametrize("by_descriptor", [True, False])
@torch.inference_mode()
def test_the_attention_kernel_equals_the_torch_attention(heads, groups, q, capacity, length, dim, causal,
                                                         by_descriptor, monkeypatch):
    """attend_until (keys up to the pass's last slot, the mask read over the pass's own keys; the keys
    split 1, 3 or 8 ways and merged) in float16 against float32 attention over exactly the visible
    keys (keys after the pass are NaN: reading one would show), its whole K/V tiles by TMA descriptors
    (Hopper's form) or by block pointers (an RTX A6000's). With each node's ``ends``, each block of rows
    stops at its furthest key: the same output (bit for bit unsplit: the keys left out are masked for
    every row of the block), and another with ends that leave visible keys out (so they are read)."""
    from workers.models import attention_triton
    from workers.models.attention_triton import attend_until

    monkeypatch.setattr(attention_triton, "BY_DESCRIPTOR", by_descriptor)
    (query, key, value, mask, slots, ends), want, want_by_node = attention_case(heads, groups, q, capacity, length,
                                                                                dim, causal)
    for splits in (1, 3, 8):
        got = attend_until(query, key, value, mask, slots, dim**-0.5, splits)
        assert got.dtype == torch.float16 and torch.isfinite(got).all()
        assert relative(got, want) < 2e-3  # float16's rounding of the output is 5e-4 at most
        by_node = attend_until(query, key, value, mask, slots, dim**-0.5, splits, nodes=q)
        assert by_node.shape == (q, heads * groups * dim)
        assert torch.equal(by_node, got.reshape(heads * groups, q, dim).transpose(0, 1).reshape(q, -1))
        assert relative(by_node, want_by_node) < 2e-3
        if splits < 8:
            bounded = attend_until(query, key, value, mask, slots, dim**-0.5, splits, nodes=q, ends=ends)
            assert relative(bounded, want_by_node) < 2e-3
            assert splits > 1 or torch.equal(bounded, by_node)
    if q > 1:  # every node's keys cut after the pass's first: the visible later keys go missing
        short = attend_until(query, key, value, mask, slots, dim**-0.5, 1, nodes=q, ends=torch.full_like(ends, ends[0]))
        assert relative(short, want_by_node) > 1e-2


@pytest.mark.parametrize(("heads", "groups", "q", "capacity", "length", "dim", "causal"),
                         [(2, 3, 30, 200, 100, 32, False), (2, 1, 257, 700, 0, 16, False),
                          (1, 2, 160, 300, 0, 32, True)])
@pytest.mark.parametrize("by_descriptor", [True, False])
@torch.inference_mode()
def test_the_shared_work_equals_the_torch_attention(heads, groups, q, capacity, length, dim, causal, by_descriptor,
                                                    monkeypatch):
    """attend_until with ``programs`` sharing the (row block, K/V head, key tile) work (stream-K): from a
    third of the items' count (a program holding parts of up to four items) to more programs than tiles,
    each item's parts merged by the count its first program writes; plain and in o_proj's layout with each
    node's ``ends`` (blocks that end at different keys: a prompt chunk's causal triangle), against float32
    attention over exactly the visible keys (keys after the pass are NaN). ``sharing`` routes a call
    without ``splits`` through it."""
    from workers.models import attention_triton
    from workers.models.attention_triton import attend_until, sharing

    monkeypatch.setattr(attention_triton, "BY_DESCRIPTOR", by_descriptor)
    (query, key, value, mask, slots, ends), want, want_by_node = attention_case(heads, groups, q, capacity, length,
                                                                                dim, causal)
    for programs in (1, 5, 13, 40):
        got = attend_until(query, key, value, mask, slots, dim**-0.5, programs=programs)
        assert torch.isfinite(got).all() and relative(got, want) < 2e-3
        bounded = attend_until(query, key, value, mask, slots, dim**-0.5, nodes=q, ends=ends, programs=programs)
        assert relative(bounded, want_by_node) < 2e-3
    # a GPU of 64 multiprocessors, one program each (Triton's interpreter runs what it is given)
    monkeypatch.setattr(attention_triton, "multiprocessors", lambda device: 64)
    with sharing(True):
        assert torch.equal(attend_until(query, key, value, mask, slots, dim**-0.5),
                           attend_until(query, key, value, mask, slots, dim**-0.5, programs=64))


@torch.inference_mode()
def test_the_attention_form_is_chosen_once_per_pass_shape(monkeypatch):
    """``SHARED`` None: a pass shape first met inside ``lt_product.choosing()`` runs both forms on its own
    inputs and keeps the shared one where it agrees with the key splits and beats their time by FORM_MARGIN
    (``halving_clock`` times it at half theirs); later calls, outside, run the kept form
    (the same bits as that form named). A form that does not agree within FORM_AGREEMENT is refused with a
    warning; a shape first met outside ``choosing()`` keeps the key splits, untimed."""
    from workers.models import attention_triton, lt_product
    from workers.models.attention_triton import attend_until

    # a GPU of 3 multiprocessors, one program each: 4 items (2 row blocks x 2 K/V heads) in 2 key splits, or
    # shared among 3 programs
    monkeypatch.setattr(attention_triton, "multiprocessors", lambda device: 3)
    monkeypatch.setattr(attention_triton, "SHARED", None)
    monkeypatch.setattr(lt_product, "time_calls", halving_clock)
    (query, key, value, mask, slots, ends), _, want_by_node = attention_case(2, 3, 30, 200, 100, 32, False)

    def attend(shared=None):
        return attend_until(query, key, value, mask, slots, 32**-0.5, nodes=30, ends=ends, shared=shared)

    split_form, shared_form = attend(False), attend(True)
    assert not torch.equal(split_form, shared_form)  # the two divisions differ at this shape
    for margin, kept in ((0.4, shared_form), (0.6, split_form)):
        monkeypatch.setattr(attention_triton, "_FORMS", {})
        monkeypatch.setattr(attention_triton, "_TRIALS", {})
        monkeypatch.setattr(attention_triton, "FORM_MARGIN", margin)
        with lt_product.choosing():
            first = attend()
        assert torch.equal(first, kept) and torch.equal(attend(), kept)
        assert relative(first, want_by_node) < 2e-3
        [line] = attention_triton.report()
        assert "splits" in line and "shared" in line
        assert line.endswith("shared" if kept is shared_form else "key splits")

    monkeypatch.setattr(attention_triton, "_FORMS", {})
    monkeypatch.setattr(attention_triton, "_TRIALS", {})
    monkeypatch.setattr(attention_triton, "FORM_MARGIN", -100.0)
    monkeypatch.setattr(attention_triton, "FORM_AGREEMENT", 0.0)  # any difference refused
    with lt_product.choosing(), pytest.warns(UserWarning, match="differs from the key splits"):
        assert torch.equal(attend(), split_form)
    monkeypatch.setattr(attention_triton, "_FORMS", {})
    monkeypatch.setattr(attention_triton, "_TRIALS", {})
    monkeypatch.setattr(attention_triton, "FORM_AGREEMENT", 1e-2)
    assert torch.equal(attend(), split_form) and attention_triton.report() == []  # first met outside: no trial
    with lt_product.choosing():
        assert torch.equal(attend(), split_form)  # and kept


def test_how_the_work_is_divided():
    """``division`` at an H200's widths: key splits unless ``shared`` (or ``programs``); shared, an item's
    tiles span at most programs / items + 1 programs, with programs at least a third of the items; the
    memory plan's bound and ``MAX_KEY_SPLITS`` cap the parts (below 2: key splits again)."""
    from workers.models.attention_triton import division
    from workers.models.kernels import MAX_KEY_SPLITS

    assert division(17, 8, 1028, 396, 132) == (None, 2)  # the 8B shape's 257-row pass: 3 programs an SM
    assert division(17, 8, 1028, 396, 132, programs=100) == (100, 2)  # a program holds parts of up to 3 items
    assert division(17, 8, 1028, 396, 132, programs=10) == (46, 2)  # at least a third of the items
    assert division(17, 8, 1028, 396, 132, programs=5000) == (5000, MAX_KEY_SPLITS)
    assert division(17, 8, 1028, 396, 132, shared=True) == (396, 4)
    assert division(13, 4, 1542, 132, 132, shared=True) == (132, 4)  # the 27B shape's: one 128-row program an SM
    assert division(17, 8, 1028, 396, 132, splits=3, shared=True) == (None, 3)
    assert division(64, 8, 4096, 396, 132, shared=True) == (396, 2)  # a prompt chunk: more items than resident
    assert division(64, 8, 4096, 1000, 2, shared=True) == (None, 1)  # the partial sums' bound leaves no room


@pytest.mark.parametrize(("q", "groups", "dim", "tma"),
                         [(1, 4, 128, False), (4, 4, 128, False), (17, 4, 128, False), (65, 4, 128, True),
                          (257, 4, 128, True), (1024, 4, 128, True), (1, 6, 256, True), (17, 6, 256, True),
                          (1025, 6, 256, True)])
def test_tma_is_taken_where_it_measured_faster(q, groups, dim, tma, monkeypatch):
    """``uses_descriptors`` at the widths timed on an H200 (wide_passes_h200.md, eighth session): the
    Qwen3-8B shape's decode steps and 17-node chains by block pointers, its passes of 65 nodes and more by
    TMA; the Qwen3.6-27B shape's (head size 256) by TMA at every width. Forced either way, it obeys."""
    from workers.models import attention_triton

    assert attention_triton.uses_descriptors(groups * q, dim) is tma
    for forced in (True, False):
        monkeypatch.setattr(attention_triton, "BY_DESCRIPTOR", forced)
        assert attention_triton.uses_descriptors(groups * q, dim) is forced


@pytest.mark.parametrize(("programs", "resident", "sms", "fastest"),
                         [(28, 132, 132, 4), (52, 132, 132, 2), (100, 132, 132, 1), (196, 132, 132, 2),
                          (136, 396, 132, 2), (512, 396, 132, 1), (8, 396, 132, 8), (4, 132, 132, 8)])
def test_the_key_splits_are_the_measured_choices(programs, resident, sms, fastest):
    """``split_count`` at an H200's widths against the measured (benchmarks/results/wide_passes_h200.md,
    seventh session): the fastest split count of the grids for the 27B shape's 128-row programs at
    q = 129, 257, 513, 1025 (one a multiprocessor) and the 8B shape's 64-row programs at q = 257 (three);
    the counts the passes were measured with for a 1024-token prompt chunk of the 8B shape (1: 2 would
    break the memory plan's 4 programs a multiprocessor) and decode steps' few programs (8, the most)."""
    from workers.models.attention_triton import split_count

    assert split_count(programs, resident, sms) == fastest
    assert split_count(programs, resident, sms) * programs <= max(programs, 4 * sms)


@pytest.mark.parametrize(("chain", "q"), [(False, 40), (False, 129), (True, 40), (True, 1), (True, 7)])
@torch.inference_mode()
def test_a_gdn_layer_through_the_kernels_equals_its_torch_path(chain, q):
    """A whole GDN layer (fused projection, conv prologue, tree solve or chain rule, gated norm; a chain
    committed as it goes) through the kernels against its torch path: outputs, and for a chain the
    state and conv window it leaves. At 129 nodes the root is apart from the tree kernel's blocks."""
    from workers.models.gdn import TreeShape
    from workers.models.gdn_layer import gdn_layer_for
    from workers.models.shapes import build_random_target

    model = build_random_target("qwen3.6-mini", torch.float32, torch.device("cpu"))
    layer = gdn_layer_for(model.model.layers[0].linear_attn)
    g = torch.Generator().manual_seed(q)
    hidden = torch.randn(1, q, model.config.hidden_size, generator=g)
    parents = torch.arange(-1, q - 1) if chain else random_tree_parents(q, 15, g)
    shape = TreeShape.build(parents, layer.window, chain, commits=chain).with_blocks()
    window0 = torch.randn(layer.window, layer.conv_dim, generator=g)
    state0 = torch.randn(layer.state_shape, generator=g) * 0.3
    results = []
    for kernels in (False, True):
        layer.kernels = kernels
        window, state = window0.clone(), state0.clone()
        out, _ = layer(hidden, shape, window, state, commit=chain)
        results.append((out, state, window))
    (want, want_state, want_window), (got, got_state, got_window) = results
    assert relative(got, want) < 1e-5
    if chain:
        assert relative(got_state, want_state) < 1e-5
        assert torch.equal(got_window, want_window)


@pytest.mark.parametrize("form", ["replay", "chunk"])
def test_greedy_decoding_through_the_gdn_kernels_equals_ar(tiny_hybrid_kernels, form, monkeypatch):
    """DFlash and DDTree on the float32 hybrid target with its GDN layers through the kernels (conv
    prologue, tree solve, gated norm, the chain step, each commit form) give AR's tokens: the kernels
    keep greedy decoding exact end to end, and commits of more than one token ran."""
    from workers.decoding import ar, ddtree, dflash
    from workers.decoding.generation import GenerationConfig
    from workers.decoding.params import DFlashParams, TreeParams
    from workers.models import gdn_triton
    from workers.models.runner.target import StaticTarget

    monkeypatch.setattr(gdn_triton, "COMMIT_FORM", form)
    lengths, commit_path = [], gdn_triton.commit_path

    def counted(extended, path, *args, **kwargs):
        lengths.append(path.shape[0])
        return commit_path(extended, path, *args, **kwargs)

    monkeypatch.setattr(gdn_triton, "commit_path", counted)
    tiny_hybrid = tiny_hybrid_kernels
    target = StaticTarget(tiny_hybrid.model, tiny_hybrid.drafter.spec.target_layer_ids, graphs=False)
    for layer in target.loop.gdn.values():  # on the CPU they run the torch forms unless told (kept on the
        monkeypatch.setattr(layer, "kernels", True)  # fixture's mixers: undone after the test)
    prompt = torch.randint(1, tiny_hybrid.shape.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    config = GenerationConfig(max_new_tokens=12, seed=1)
    reference = ar.generate(target, None, prompt, config).token_ids
    for engine, params in ((dflash.generate, DFlashParams()), (ddtree.generate, TreeParams(16))):
        assert engine(target, tiny_hybrid.drafter, prompt, config, params).token_ids == reference
    assert max(lengths, default=0) > 1


@pytest.mark.parametrize(("bias", "dtype"), [(False, torch.float32), (True, torch.float32), (True, torch.float16)])
@torch.inference_mode()
def test_a_commit_through_the_kernels_equals_the_torch_commit(bias, dtype):
    """A GDN layer's commit of a tree pass's path (conv over the path, the delta rule from the committed
    state, the new conv window), token by token and in the regrouped form, against the torch commit:
    every length 1..16 along a 16-node chain, and a path that leaves it. In float16 the torch conv rounds
    its sum, the bias and the SiLU each to float16 where the kernels round once, so they agree with it to
    a few roundings, and with each other to float32's."""
    from workers.models.gdn import TreeShape, ancestor_table
    from workers.models.gdn_layer import gdn_layer_for
    from workers.models.gdn_triton import commit_path
    from workers.models.shapes import build_random_target

    model = build_random_target("qwen3.6-mini", dtype, torch.device("cpu"))
    mixer = model.model.layers[0].linear_attn
    g = torch.Generator().manual_seed(11)
    mixer.A_log.data.fill_(-4.0)  # slow decay, and (below) aligned keys: L's powers up to L^8 weigh in the
    # solve (with random weights they sit below the tolerance, and a solve short of a factor passes)
    if bias:  # Qwen3.5's conv has none; transformers' module allows one
        mixer.conv1d.bias = nn.Parameter((torch.randn(mixer.conv_dim, generator=g) * 0.1 + 2.0).to(dtype))
    layer = gdn_layer_for(mixer)
    q = 40
    parents = deep_tree_parents(q, g)
    hidden = torch.randn(1, q, model.config.hidden_size, generator=g).to(dtype)
    shape = TreeShape.build(parents, layer.window, chain=False)
    window0 = torch.randn(layer.window, layer.conv_dim, generator=g).to(dtype)
    state0 = torch.randn(layer.state_shape, generator=g) * 0.3
    pending = layer(hidden, shape, window0.clone(), state0.clone())[1]
    table = ancestor_table(parents)
    deepest = max(range(16, q), key=lambda n: int(table[n].lt(q).sum()))
    branch_path = sorted(int(a) for a in table[deepest] if a < q)  # ancestors come before a node in the order
    assert len(branch_path) > 6 and branch_path[4] >= 16
    layer.kernels = False
    tolerance = 1e-5 if dtype == torch.float32 else 1e-3
    for nodes in [list(range(length)) for length in range(1, 17)] + [branch_path]:
        path = torch.tensor(nodes)
        results = {}
        for form in ("torch", "replay", "chunk"):
            window, state = window0.clone(), state0.clone()
            if form == "torch":
                layer.commit(pending, path, window, state)
            else:
                commit_path(pending.extended, path, mixer.conv1d.weight[:, 0, :], mixer.conv1d.bias, pending.log_gate,
                            pending.beta, state, window, mixer.num_k_heads, form=form)
            results[form] = state, window
        for form in ("replay", "chunk"):
            assert relative(results[form][0], results["torch"][0]) < tolerance, (form, len(nodes))
            assert torch.equal(results[form][1], results["torch"][1]), (form, len(nodes))
        assert relative(results["chunk"][0], results["replay"][0]) < 1e-5, len(nodes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_hybrid_layers_small_kernels_equal_their_torch_forms(dtype):
    """The (1 + w) RMS norm (rows contiguous or strided), silu(gate) * up, the attention's output gate,
    and the attention heads' norms + partial rotary + K/V write + query fold."""
    from workers.models import fused_hybrid_triton
    from workers.models.fused_hybrid import norm_rotate_heads, norm_rotate_heads_torch, one_plus_rms_norm, output_gate
    from workers.models.fused_layer import PassInputs

    g = torch.Generator().manual_seed(2)
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 4e-3}
    norm = nn.Module()
    norm.weight, norm.eps = (torch.randn(320, generator=g) * 0.3).to(dtype), 1e-6
    for x in ((torch.randn(7, 320, generator=g) * 3).to(dtype), torch.randn(3, 6, 320, generator=g).to(dtype)[:, 1:5]):
        got = fused_hybrid_triton.one_plus_rms_norm(x, norm.weight, norm.eps)
        assert got.is_contiguous()
        torch.testing.assert_close(got, one_plus_rms_norm(x, norm), **tolerance)
    gate_up = (torch.randn(5, 2 * 1500, generator=g) * 3).to(dtype)
    torch.testing.assert_close(fused_hybrid_triton.silu_mul(gate_up),
                               torch.nn.functional.silu(gate_up[:, :1500]) * gate_up[:, 1500:], **tolerance)

    q, hq, hkv, d, rotary = 5, 4, 2, 32, 8
    heads = torch.randn(q, 2 * hq + 2 * hkv, d, generator=g).to(dtype)
    for heads_out in (6, hq):  # a query-head count that is not a power of two, and one that is
        rows = torch.randn(q, 2 * heads_out + 2 * hkv, d, generator=g).to(dtype) * 3
        attended = torch.randn(q, heads_out * d, generator=g).to(dtype)
        torch.testing.assert_close(fused_hybrid_triton.output_gate(attended, rows, heads_out),
                                   output_gate(attended, rows, heads_out), **tolerance)
    q_norm, k_norm = nn.Module(), nn.Module()
    q_norm.weight, k_norm.weight = ((torch.randn(d, generator=g) * 0.3).to(dtype) for _ in range(2))
    q_norm.eps = k_norm.eps = 1e-6
    angles = torch.rand(1, q, rotary // 2, generator=g).repeat(1, 1, 2) * 6
    inputs = PassInputs.build(angles.cos().to(dtype), angles.sin().to(dtype), torch.arange(3, 3 + q),
                              torch.zeros(q, 4), hq // hkv)
    results = []
    for run in (norm_rotate_heads_torch, norm_rotate_heads):  # the torch form, the kernel
        kv = torch.zeros(2, 1, hkv, q + 5, d, dtype=dtype)
        results.append((run(heads, q_norm, k_norm, inputs, kv, hq, hkv), kv))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_plain_layers_small_kernels_equal_their_torch_forms(dtype):
    """The plain (weight) RMS norm, and the heads kernel's plain layout with Qwen3's q/k norms and
    with none (Llama): norms, full rotary, K/V write, query fold; and with no query heads."""
    from workers.models import fused_hybrid_triton
    from workers.models.fused_layer import PassInputs, norm_rotate_heads, norm_rotate_heads_torch

    g = torch.Generator().manual_seed(4)
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 4e-3}
    weight = (torch.randn(320, generator=g) * 0.3).to(dtype)
    for x in ((torch.randn(7, 320, generator=g) * 3).to(dtype), torch.randn(3, 6, 320, generator=g).to(dtype)[:, 1:5]):
        torch.testing.assert_close(fused_hybrid_triton.rms_norm(x, weight, 1e-6),
                                   torch.nn.functional.rms_norm(x, (320,), weight, 1e-6), **tolerance)
    q, d = 5, 16
    q_norm, k_norm = nn.Module(), nn.Module()
    q_norm.weight, k_norm.weight = ((torch.randn(d, generator=g) * 0.3).to(dtype) for _ in range(2))
    q_norm.variance_epsilon = k_norm.variance_epsilon = 1e-6
    angles = torch.rand(1, q, d // 2, generator=g).repeat(1, 1, 2) * 6
    # 8 heads: one program a node; 12: a second, part-filled block of heads; none of queries (K and V
    # only: a drafter's context written ahead)
    for hq, hkv in ((4, 2), (6, 3), (0, 2)):
        heads = torch.randn(q, hq + 2 * hkv, d, generator=g).to(dtype)
        inputs = PassInputs.build(angles.cos().to(dtype), angles.sin().to(dtype), torch.arange(3, 3 + q),
                                  torch.zeros(q, 4), hq // hkv)
        for norms in ((q_norm, k_norm), (None, None)):
            results = []
            for run in (norm_rotate_heads_torch, norm_rotate_heads):  # the torch form, the kernel
                kv = torch.zeros(2, 1, hkv, q + 5, d, dtype=dtype)
                results.append((run(heads.clone(), *norms, inputs, kv, hq, hkv), kv))
            for got, want in zip(results[1], results[0]):
                torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("wide_from", [1, 32])
@pytest.mark.parametrize("multiprocessors", [1, 132])
def test_the_tree_build_kernels_equal_the_torch_build(multiprocessors, wide_from, monkeypatch):
    """DDTree's tree build (two kernels per depth, the merge, the ancestor matrix) against the torch
    build, field for field and bit for bit, on random drafter rows with and without exact ties (rounded
    logits; certain positions, whose children tie their parents across depths) and random budgets, depth
    caps and branching; each depth's count in one share of the
    others per program (the interpreter's one "multiprocessor") or, as on an H200's 132, in shares
    of down to one block; by the plain count kernel or the wide one."""
    import numpy as np

    from workers.decoding import tree_triton
    from workers.decoding.params import TreeParams
    from workers.decoding.tree import build_tree

    monkeypatch.setattr(tree_triton, "multiprocessors", lambda device: multiprocessors)
    monkeypatch.setattr(tree_triton, "WIDE_COUNT_BLOCKS", wide_from)  # 1: every depth's count the wide kernel's

    rng = np.random.default_rng(0)
    cases = []
    for case in range(40):
        positions, vocab = int(rng.integers(1, 8)), int(rng.integers(2, 12))
        logits = rng.normal(size=(positions, vocab)) * rng.uniform(0.3, 4.0)
        depth = None if rng.random() < 0.4 else int(rng.integers(1, positions + 3))
        branching = None if rng.random() < 0.4 else int(rng.integers(1, vocab + 2))
        params = TreeParams(int(rng.integers(1, 80)), depth, branching)
        cases.append((np.round(logits) if case % 2 else logits, params))
    cases.append((rng.normal(size=(15, 40)) * 3, TreeParams(100)))  # a deep tree, more candidates than a block
    cases.append((np.zeros((3, 100)), TreeParams(80)))  # uniform rows: every candidate of a depth ties, across blocks
    for certain in ((1,), (0, 2, 3)):  # positions whose first token has log-prob 0: a child ties its parent
        logits = rng.normal(size=(5, 9))
        logits[list(certain), 0] = 200.0
        cases += [(logits, TreeParams(budget)) for budget in (7, 30)]
    for logits, params in cases:
        log_probs = torch.log_softmax(torch.tensor(logits, dtype=torch.float32), dim=-1)
        want, got = build_tree(log_probs, params, kernels=False), build_tree(log_probs, params, kernels=True)
        for name in ("tokens", "depths", "parents", "visibility", "log_probs"):
            expected, actual = getattr(want, name), getattr(got, name)
            assert actual.dtype == expected.dtype and torch.equal(actual, expected), (name, params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_few_rows_product_kernel_equals_the_matrix_product(dtype, rows):
    """``skinny_triton``'s product of 1-16 rows, plain and summed into a residual in place (against
    ``F.linear`` and ``addmm_``), over 100 weight rows (not a multiple of any tile's) and every tile choice."""
    from workers.models.skinny_triton import TILES, skinny_linear, tile_class

    g = torch.Generator().manual_seed(rows)
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 4e-3}
    x = (torch.randn(rows, 1024, generator=g) * 2).to(dtype)
    weight = (torch.randn(100, 1024, generator=g) * 0.05).to(dtype)
    for tiles in TILES[tile_class(rows, 1024)] + TILES[tile_class(rows, 5120)]:
        tiles = (*tiles[:3], 1)  # (the interpreter has no pipeline)
        torch.testing.assert_close(skinny_linear(x, weight, tiles=tiles), torch.nn.functional.linear(x, weight),
                                   **tolerance)
        residual = torch.randn(rows, 100, generator=g).to(dtype)
        want = residual.clone().addmm_(x, weight.t())
        got = skinny_linear(x, weight, out=residual, tiles=tiles)
        assert got is residual
        torch.testing.assert_close(residual, want, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("one_plus", [False, True])
def test_the_one_row_product_takes_the_rms_norm_before_it(dtype, one_plus):
    """``skinny_triton``'s one-row product with the RMS norm inside (x scaled by the norm's weight as it
    streams, the rsqrt scale at the end) against the norm, then the product (float32 throughout), for
    both one-row tile classes; and refused where it is not defined (more rows, a sum into ``out``)."""
    from workers.models.skinny_triton import TILES, skinny_linear, tile_class

    g = torch.Generator().manual_seed(int(one_plus))
    x = (torch.randn(1, 1024, generator=g) * 3).to(dtype)
    weight = (torch.randn(100, 1024, generator=g) * 0.05).to(dtype)
    norm_weight = (torch.randn(1024, generator=g) * 0.2 + (0.0 if one_plus else 1.0)).to(dtype)
    eps = 1e-6
    normed = torch.nn.functional.rms_norm(x.float(), (1024,), eps=eps) * (norm_weight.float() + float(one_plus))
    want = torch.nn.functional.linear(normed, weight.float())
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 4e-3}
    for tiles in TILES[tile_class(1, 1024)] + TILES[tile_class(1, 5120)] + TILES[tile_class(1, 5120, 40000)]:
        got = skinny_linear(x, weight, tiles=(*tiles[:3], 1), norm=(norm_weight, eps, one_plus))
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, **tolerance)
    with pytest.raises(ValueError, match="one row"):
        skinny_linear(x.expand(2, -1), weight, norm=(norm_weight, eps, one_plus))
    with pytest.raises(ValueError, match="one row"):
        skinny_linear(x, weight, out=torch.zeros(1, 100, dtype=dtype), norm=(norm_weight, eps, one_plus))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_few_rows_product_split_along_k_equals_the_matrix_product(dtype, rows):
    """``skinny_triton``'s product with K split over programs (each split's float32 sums written aside,
    the last split to arrive adding them in order into the output, then zeroing its tile's count):
    plain and summed into a residual, 2 and 4 splits, twice in a row (the counts must be back at 0);
    and a split count that does not divide K into whole steps refused by name."""
    from workers.models import skinny_triton
    from workers.models.skinny_triton import skinny_linear

    g = torch.Generator().manual_seed(10 + rows)
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 4e-3}
    x = (torch.randn(rows, 1024, generator=g) * 2).to(dtype)
    weight = (torch.randn(100, 1024, generator=g) * 0.05).to(dtype)
    tiles = (16, 256, 4, 1)
    for splits in (2, 4):
        for _ in range(2):
            torch.testing.assert_close(skinny_linear(x, weight, tiles=tiles, splits=splits),
                                       torch.nn.functional.linear(x, weight), **tolerance)
            residual = torch.randn(rows, 100, generator=g).to(dtype)
            want = residual.clone().addmm_(x, weight.t())
            assert skinny_linear(x, weight, out=residual, tiles=tiles, splits=splits) is residual
            torch.testing.assert_close(residual, want, **tolerance)
            assert not skinny_triton._ARRIVED["cpu"].any()
    with pytest.raises(ValueError, match="8 splits of K = 1024"):
        skinny_linear(x, weight, tiles=tiles, splits=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "splits"), [(64, 1), (70, 1), (70, 3), (90, 2), (96, 4)])
def test_the_wide_product_kernel_equals_the_matrix_product(dtype, rows, splits):
    """``wide_triton``'s product (the weight as the left operand, a 16-row tail beside the last block of
    rows, K split over programs), plain and summed into a residual in place, against ``F.linear`` and
    ``addmm_``, over 100 weight rows (not a multiple of the tile's): whole blocks (64), a tail (70), a
    block masked (90), an uneven split of the steps (3 of 8), twice in a row (the counts back at 0);
    and splits past the steps refused by name."""
    from workers.models import skinny_triton
    from workers.models.wide_triton import blocks_of, wide_linear

    g = torch.Generator().manual_seed(rows + splits)
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 4e-3}
    x = (torch.randn(rows, 128, generator=g) * 2).to(dtype)
    weight = (torch.randn(100, 128, generator=g) * 0.05).to(dtype)
    tiles = (32, 32, 16, 4, 1)  # 4 tiles of weight rows, 2-3 blocks of x rows, 8 steps of K
    assert blocks_of(rows, 32) == {64: (2, 0), 70: (2, 16), 90: (3, 0), 96: (3, 0)}[rows]
    for _ in range(2):
        torch.testing.assert_close(wide_linear(x, weight, tiles=tiles, splits=splits),
                                   torch.nn.functional.linear(x, weight), **tolerance)
        residual = torch.randn(rows, 100, generator=g).to(dtype)
        want = residual.clone().addmm_(x, weight.t())
        assert wide_linear(x, weight, out=residual, tiles=tiles, splits=splits) is residual
        torch.testing.assert_close(residual, want, **tolerance)
        if splits > 1:
            assert not skinny_triton._ARRIVED["cpu"].any()
    with pytest.raises(ValueError, match="9 splits of 8 steps"):
        wide_linear(x, weight, tiles=tiles, splits=9)


@pytest.mark.parametrize(("q", "depth"), [(1, 1), (2, 1), (16, 15), (17, 15), (40, 3), (257, 15), (300, 6),
                                          (1025, 15)])
@pytest.mark.parametrize("chain", [False, True])
def test_the_tree_shape_kernels_equal_the_torch_forms(q, depth, chain):
    """tree_shape (ancestors, conv rows, the tree kernel's blocks from the counted preorder) against
    ancestor_table, conv_lag_index and tree_blocks, element for element, for trees and chains."""
    from workers.models.gdn import MAX_PATH, ancestor_table, conv_lag_index
    from workers.models.tree_blocks import tree_blocks
    from workers.models.tree_shape_triton import tree_shape

    if chain and q > MAX_PATH:
        pytest.skip("a long chain takes the chunked form, without ancestors or blocks")
    parents = torch.arange(q) - 1 if chain else random_tree_parents(q, depth, torch.Generator().manual_seed(q))
    for window in (1, 3):
        ancestors, lag_index, slots, mask = tree_shape(parents, window, MAX_PATH)
        want = ancestor_table(parents)
        assert torch.equal(ancestors, want)
        assert torch.equal(lag_index, conv_lag_index(parents, window))
        want_slots, want_mask = tree_blocks(want)
        assert torch.equal(slots, want_slots) and torch.equal(mask, want_mask)
