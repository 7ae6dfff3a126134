"""The Triton tree kernel against the torch tree form (GPU only; skipped on CPU machines).

Same inputs, float32: the kernel's per-node outputs must equal the torch path's (which the CPU tests
hold to transformers' sequential kernel), for trees of depth up to MAX_PATH - 1 and real head sizes;
and a hybrid whose GDN layers take the kernel must give, on CUDA, the CPU runner's tree logits.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.kernel_inputs import deep_tree_parents, random_tree_parents
from workers.models.gdn import MAX_PATH, ancestor_table, tree_delta_rule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("form", [(32, 3, 1), (32, 2, 1), (64, 2, 1), (32, 3, 2), (32, 2, 2)])
@pytest.mark.parametrize("q, depth, dk, dv", [(1, 1, 16, 16), (17, 15, 128, 128), (257, 15, 128, 128),
                                              (300, 6, 64, 32), (80, "deep", 128, 128)])
def test_triton_tree_kernel_equals_the_torch_path(q, depth, dk, dv, form, monkeypatch):
    """The deep case: 16-node paths, aligned keys and slow decay, where every factor of the solve weighs.
    In every form (step along dk, pipeline stages, blocks a program: ``gdn_triton.TREE_FORM``); with
    blocks in pairs, an odd count of blocks at 17, 300 and 80 nodes."""
    from workers.models import gdn_triton

    monkeypatch.setattr(gdn_triton, "TREE_FORM", form)
    g = torch.Generator().manual_seed(q)
    hk, h = 4, 12
    deep = depth == "deep"
    parents = deep_tree_parents(q, g) if deep else random_tree_parents(q, min(depth, MAX_PATH - 1), g)
    inputs = [torch.randn(q, hk, dk, generator=g), torch.randn(q, hk, dk, generator=g) + 3 * deep,
              torch.randn(q, h, dv, generator=g), -torch.rand(q, h, generator=g) * (0.05 if deep else 2),
              torch.rand(q, h, generator=g), torch.randn(h, dk, dv, generator=g) * 0.3]
    cuda = [x.cuda() for x in inputs]
    ancestors = ancestor_table(parents).cuda()
    want = tree_delta_rule(*cuda, ancestors, use_triton=False)
    got = tree_delta_rule(*cuda, ancestors, use_triton=True)
    assert torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("form", [(32, 3, 1), (32, 2, 1), (64, 2, 1), (32, 3, 2), (32, 2, 2)])
@pytest.mark.parametrize("q", [16, 257, 1025])
def test_the_bfloat16_models_tf32_tree_kernel_stays_below_bfloat16_rounding(q, form):
    """For a bfloat16 model the blocked solve's products run in tf32: all outputs within 5e-3 relative
    of the float32 torch form (bfloat16's own rounding is 3.9e-3), at real head sizes, in every form."""
    from workers.models.gdn import l2_normalize, tree_delta_rule_normalized
    from workers.models.gdn_triton import tree_outputs

    g = torch.Generator().manual_seed(q)
    hk, h, d = 4, 12, 128
    parents = random_tree_parents(q, MAX_PATH - 1, g)
    q_ = (l2_normalize(torch.randn(hk, q, d, generator=g)) * d**-0.5).cuda()
    k_ = l2_normalize(torch.randn(hk, q, d, generator=g)).cuda()
    v_, state = torch.randn(h, q, d, generator=g).cuda(), (torch.randn(h, d, d, generator=g) * 0.3).cuda()
    log_gate, beta = (-torch.rand(q, h, generator=g) * 2).cuda(), torch.rand(q, h, generator=g).cuda()
    ancestors = ancestor_table(parents).cuda()
    want = tree_delta_rule_normalized(q_, k_, v_, log_gate, beta, state, ancestors, use_triton=False)
    kq = torch.stack((k_, q_), dim=1)  # [Hk, 2, q, d], the prologue's layout
    got = tree_outputs(kq, v_, log_gate, beta, state, ancestors, model_dtype=torch.bfloat16, form=form)
    assert ((got - want).norm() / want.norm()).item() < 5e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q", [17, 300])
def test_the_gated_norm_in_the_tree_kernels_epilogue_equals_the_norm_kernel_after_it(dtype, q):
    """tree_outputs(norm=...) (the gated norm applied to each output row in the tree kernel) gives
    gated_norm(tree_outputs(...)), with z's rows strided as the fused projection gives them: the same
    operations, so equal but for the order of the row sums (an ulp of the model dtype at most)."""
    from workers.models.gdn import l2_normalize
    from workers.models.gdn_triton import gated_norm, tree_outputs

    g = torch.Generator().manual_seed(q)
    hk, h, d = 4, 12, 128
    parents = random_tree_parents(q, MAX_PATH - 1, g)
    q_ = (l2_normalize(torch.randn(hk, q, d, generator=g)) * d**-0.5).cuda()
    k_ = l2_normalize(torch.randn(hk, q, d, generator=g)).cuda()
    kq = torch.stack((k_, q_), dim=1)
    v_, state = torch.randn(h, q, d, generator=g).cuda(), (torch.randn(h, d, d, generator=g) * 0.3).cuda()
    log_gate, beta = (-torch.rand(q, h, generator=g) * 2).cuda(), torch.rand(q, h, generator=g).cuda()
    ancestors = ancestor_table(parents).cuda()
    z = torch.randn(q, h * d + 40, generator=g).to(dtype).cuda()[:, 8 : 8 + h * d]
    weight = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).cuda()
    plain = tree_outputs(kq, v_, log_gate, beta, state, ancestors, model_dtype=dtype)
    fused = tree_outputs(kq, v_, log_gate, beta, state, ancestors, model_dtype=dtype, norm=(z, weight, 1e-6))
    assert fused.dtype == dtype and fused.shape == (q, h * d)
    want = gated_norm(plain, z, weight, 1e-6, dtype).float()
    assert ((fused.float() - want).abs() <= torch.finfo(dtype).eps * want.abs() + 1e-6).all()


@pytest.mark.parametrize("q", [17, 257])
@torch.inference_mode()
def test_every_form_gives_the_same_bits_and_a_graph_replays_the_form_chosen_on_trial(q, monkeypatch):
    """The premise of choosing the tree kernel's form on trial (``TREE_FORM`` None): each of FORM_CHOICES
    (and PAIRED_FORMS, slower on an H100 and kept out) gives the same bits (a bfloat16 model's tf32 products,
    the gated norm in the epilogue; the root's program sums in steps of ``ROOT_STEP`` in every form, without
    which the step of 64 failed this at 257 nodes). A pass captured by ``graph_cache.capture`` has its form
    chosen in the warm-ups (``forms_report``), and the replay gives those bits, on new inputs too."""
    from workers.models import gdn_triton, graph_cache
    from workers.models.gdn import l2_normalize

    monkeypatch.setattr(gdn_triton, "TREE_FORM", None)
    monkeypatch.setattr(gdn_triton, "_FORMS", {})
    monkeypatch.setattr(gdn_triton, "_FORM_TRIALS", {})
    g = torch.Generator().manual_seed(q)
    hk, h, d = 16, 48, 128  # the 27B's GDN heads
    ancestors = ancestor_table(random_tree_parents(q, MAX_PATH - 1, g)).cuda()
    kq = torch.stack((l2_normalize(torch.randn(hk, q, d, generator=g)),
                      l2_normalize(torch.randn(hk, q, d, generator=g)) * d**-0.5), dim=1).cuda()
    v_, state = torch.randn(h, q, d, generator=g).cuda(), (torch.randn(h, d, d, generator=g) * 0.3).cuda()
    log_gate, beta = (-torch.rand(q, h, generator=g) * 2).cuda(), torch.rand(q, h, generator=g).cuda()
    z = torch.randn(q, h * d, generator=g).to(torch.bfloat16).cuda()
    weight = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16).cuda()

    def solve(form=None):
        return gdn_triton.tree_outputs(kq, v_, log_gate, beta, state, ancestors, model_dtype=torch.bfloat16,
                                       norm=(z, weight, 1e-6), form=form)

    by_form = [solve(form) for form in gdn_triton.FORM_CHOICES + gdn_triton.PAIRED_FORMS]
    assert all(torch.equal(out, by_form[0]) for out in by_form[1:])
    graph, replayed = graph_cache.capture(solve)
    [line] = gdn_triton.forms_report()
    assert f"{q} nodes, {h} heads" in line
    graph.replay()
    assert torch.equal(replayed, by_form[0])
    v_.copy_(torch.randn(h, q, d, generator=g))
    graph.replay()
    assert torch.equal(replayed, solve(gdn_triton.FORM_CHOICES[-1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prologue_kernel_equals_the_torch_conv_norms_and_gates(dtype):
    """The conv prologue reading the window and strided node inputs in place: the extended inputs
    exactly, q_/k_/v, beta and log_gate as the torch path computes them (softplus over a wide range)."""
    import torch.nn.functional as F

    from workers.models.gdn import conv_lag_index, l2_normalize, tree_conv
    from workers.models.gdn_triton import prologue

    g = torch.Generator().manual_seed(3)
    hk, h, d, taps, q = 4, 12, 64, 4, 33
    channels = 2 * hk * d + h * d
    parents = random_tree_parents(q, 15, g)
    lag_index = conv_lag_index(parents, taps - 1).cuda()
    projection = torch.randn(q, channels + 40 + 2 * h, generator=g).to(dtype).cuda()  # [conv inputs | z | b | a]
    inputs, b, a = projection[:, :channels], projection[:, -2 * h : -h], projection[:, -h:] * 10
    window = torch.randn(taps - 1, channels, generator=g).to(dtype).cuda()
    weight, bias = torch.randn(channels, taps, generator=g).to(dtype).cuda(), torch.randn(channels).to(dtype).cuda()
    A_log, dt_bias = torch.randn(h).to(dtype).cuda(), torch.randn(h).to(dtype).cuda()
    extended = torch.empty(taps - 1 + q, channels, dtype=dtype, device="cuda")
    got = prologue(window, inputs, lag_index, weight, bias, hk, h, d, extended, (b, a, A_log, dt_bias))

    conv, want_extended = tree_conv(inputs, window, weight, bias, lag_index)
    query, key, value = conv.to(dtype).float().split([hk * d, hk * d, h * d], dim=-1)
    want_q = (l2_normalize(query.view(q, hk, d)) * d**-0.5).transpose(0, 1)  # once per key head
    want_k = l2_normalize(key.view(q, hk, d)).transpose(0, 1)
    want_log_gate = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    assert torch.equal(extended, want_extended)
    assert got.kq.shape == (hk, 2, q, d)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.kq[:, 1], want_q, **tolerance)
    torch.testing.assert_close(got.kq[:, 0], want_k, **tolerance)
    torch.testing.assert_close(got.v, value.view(q, h, d).transpose(0, 1), **tolerance)
    torch.testing.assert_close(got.beta, b.sigmoid(), **tolerance)
    torch.testing.assert_close(got.log_gate, want_log_gate, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_hybrid_on_cuda_through_the_kernel_gives_the_cpu_tree_logits():
    from workers.decoding.params import TreeParams
    from workers.decoding.tree import build_tree
    from workers.models.runner.target import StaticTarget
    from workers.models.shapes import build_random_target

    cpu_model = build_random_target("qwen3.6-mini", torch.float32, torch.device("cpu"))  # GDN heads of 32
    cuda_model = copy.deepcopy(cpu_model).cuda()
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 4000, (1, 40), generator=generator)
    log_probs = torch.log_softmax(torch.randn(15, 4096, generator=generator) * 3, dim=-1)
    tree = build_tree(log_probs, TreeParams(64))
    outputs = []
    for model, graphs in ((cpu_model, False), (cuda_model, False), (cuda_model, True)):
        target = StaticTarget(model, graphs=graphs)
        device = target.device
        target.start(capacity=256, max_verify=65)
        target.prefill(prompt.to(device))
        outputs.append(target.verify_tree(prompt[0, -1].to(device), tree.to(device)).logits.float().cpu().clone())
    for got in outputs[1:]:
        torch.testing.assert_close(got, outputs[0], atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("chain", "q"), [(False, 40), (True, 40), (True, 1), (True, 7)])
@torch.inference_mode()
def test_gdn_layer_through_the_kernels_equals_its_torch_path(dtype, chain, q):
    """Fused projection + conv prologue + tree (or chunked) rule + gated norm against the module path:
    outputs, and (a chain kept whole) the state and conv window it leaves (<= 16 tokens: the
    recurrence kernel with outputs, AR's advance; longer: the chunked form)."""
    from workers.models.gdn import TreeShape
    from workers.models.gdn_layer import gdn_layer_for
    from workers.models.shapes import build_random_target

    model = build_random_target("qwen3.6-mini", dtype, torch.device("cuda"))
    layer = gdn_layer_for(model.model.layers[0].linear_attn)
    assert layer.kernels and layer.projection is not None
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(1, q, 256, generator=generator).to(dtype).cuda()
    parents = torch.arange(-1, q - 1) if chain else random_tree_parents(q, 15, generator)
    shape = TreeShape.build(parents.cuda(), layer.window, chain, commits=chain)
    window0 = torch.randn(layer.window, layer.conv_dim, generator=generator).to(dtype).cuda()
    state0 = (torch.randn(layer.state_shape, generator=generator) * 0.3).cuda()
    results = []
    for kernels in (False, True):
        layer.kernels = kernels
        window, state = window0.clone(), state0.clone()
        out, _ = layer(hidden, shape, window, state, commit=chain)
        results.append((out.float(), state, window.float()))
    (want, want_state, want_window), (got, got_state, got_window) = results
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert ((got - want).norm() / want.norm()).item() < tolerance
    # the residual in out_proj's epilogue, added in place
    residual = hidden.clone()
    summed, _ = layer(hidden, shape, window0.clone(), state0.clone(), commit=chain, residual=residual)
    want_summed = hidden.float() + got
    assert summed is residual
    assert ((summed.float() - want_summed).norm() / want_summed.norm()).item() < tolerance
    if chain:
        assert ((got_state - want_state).norm() / want_state.norm()).item() < tolerance
        assert torch.equal(got_window, want_window)


@pytest.mark.parametrize(("q", "chain", "commits"), [(40, False, False), (9, True, False), (9, True, True)])
def test_a_cpu_built_shape_moved_to_cuda_equals_one_built_there(q, chain, commits):
    """``TreeShape.to`` (a split target's first segment on the CPU hands its pass to a GPU) gives what
    ``build`` gives on the GPU: the two Triton launches' blocks for a tree kernel's pass, none for a
    committing one."""
    from workers.models.gdn import TreeShape

    parents = torch.arange(-1, q - 1) if chain else random_tree_parents(q, 15, torch.Generator().manual_seed(q))
    moved = TreeShape.build(parents, 3, chain, commits).to(torch.device("cuda"))
    built = TreeShape.build(parents.cuda(), 3, chain, commits)
    assert (moved.block_slots is None) == commits
    for name, want in vars(built).items():
        got = getattr(moved, name)
        assert got == want if not isinstance(want, torch.Tensor) else (got.is_cuda and torch.equal(got, want)), name


@torch.inference_mode()
@pytest.mark.parametrize("form", ["replay", "chunk"])
@pytest.mark.parametrize("bias", [False, True])
def test_commit_through_the_kernels_equals_the_chunked_replay(bias, form, monkeypatch):
    """A commit's path through the one-kernel commit (conv over the path, the recurrence in registers or
    the regrouped solve, the new conv window) against the torch chunked replay, paths of 1 to 16 nodes.
    Slow decay and (with the bias) aligned keys, so that the whole path weighs in the solve."""
    from workers.models import gdn_triton
    from workers.models.gdn import TreeShape
    from workers.models.gdn_layer import gdn_layer_for
    from workers.models.shapes import build_random_target

    monkeypatch.setattr(gdn_triton, "COMMIT_FORM", form)
    model = build_random_target("qwen3.6-mini", torch.float32, torch.device("cuda"))
    mixer = model.model.layers[0].linear_attn
    mixer.A_log.data.fill_(-4.0)
    if bias:  # Qwen3.5's conv has none; the kernel takes one as transformers' module allows
        mixer.conv1d.bias = torch.nn.Parameter(torch.randn(mixer.conv_dim, device="cuda") * 0.1 + 2.0)
    layer = gdn_layer_for(mixer)
    generator = torch.Generator().manual_seed(8)
    q = 48
    parents = deep_tree_parents(q, generator)
    hidden = torch.randn(1, q, 256, generator=generator).cuda()
    shape = TreeShape.build(parents.cuda(), layer.window, chain=False)
    window0 = torch.randn(layer.window, layer.conv_dim, generator=generator).cuda()
    state0 = (torch.randn(layer.state_shape, generator=generator) * 0.3).cuda()
    deepest = max(range(16, q), key=lambda n: int(ancestor_table(parents)[n].lt(q).sum()))
    for node in (0, 1, 5, 12, 15, q - 1, deepest):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        path = torch.tensor(path[::-1]).cuda()
        results = []
        for kernels in (False, True):
            layer.kernels = True
            window, state = window0.clone(), state0.clone()
            _, pending = layer(hidden, shape, window, state)
            layer.kernels = kernels
            layer.commit(pending, path, window, state)
            results.append((state, window))
        torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
        assert torch.equal(results[1][1], results[0][1])


def test_a_gdn_layer_on_cuda_compiles_every_commit_length_up_front():
    """The commit kernel's length is a compile-time constant: every length is compiled when the layer is
    made (not by the first commit of that length, inside a timed round), and a second layer of the
    same shape compiles nothing again."""
    from workers.models import gdn_triton
    from workers.models.gdn_layer import GDNLayer
    from workers.models.shapes import build_random_target

    model = build_random_target("qwen3.6-mini", torch.bfloat16, torch.device("cuda"))
    mixer = model.model.layers[0].linear_attn
    layer = GDNLayer(mixer)
    assert layer.kernels
    key = (mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.conv_kernel_size, torch.bfloat16,
           mixer.conv1d.bias is not None, "cuda:0", gdn_triton.COMMIT_FORM)
    assert key in gdn_triton._COMPILED_COMMITS
    size = len(gdn_triton._COMPILED_COMMITS)
    GDNLayer(model.model.layers[1].linear_attn)
    assert len(gdn_triton._COMPILED_COMMITS) == size


@torch.inference_mode()
def test_fla_chunked_rule_equals_the_torch_chunked_form():
    """A prompt chunk's delta rule through fla-core (what bf16 models use when it is installed) against
    the torch chunked form: outputs and the final state, Qwen3.6's heads (16 key, 48 value), 300 tokens
    from a non-zero state. fla's chunks run on tensor cores (tf32), hence the tolerance."""
    from workers.models.gdn import chain_delta_rule_normalized, l2_normalize
    from workers.models.gdn_layer import _fla_chunked, fla_chunk_rule

    rule = fla_chunk_rule()
    if rule is None:
        pytest.skip("fla-core is not installed")
    generator = torch.Generator().manual_seed(11)
    q, key_heads, heads, d = 300, 16, 48, 128
    keys = l2_normalize(torch.randn(key_heads, q, d, generator=generator))
    queries = l2_normalize(torch.randn(key_heads, q, d, generator=generator)) * d**-0.5
    kq = torch.stack((keys, queries), dim=1).cuda()  # [Hk, 2, q, d] as the prologue writes it
    v_ = torch.randn(heads, q, d, generator=generator).cuda()
    log_gate = (-torch.rand(q, heads, generator=generator) * 0.5).cuda()
    beta = torch.rand(q, heads, generator=generator).to(torch.bfloat16).cuda()
    state0 = (torch.randn(heads, d, d, generator=generator) * 0.3).cuda()
    want, want_state = chain_delta_rule_normalized(kq[:, 1], kq[:, 0], v_, log_gate, beta, state0)
    state = state0.clone()
    got = _fla_chunked(rule, kq, v_, log_gate, beta, state, commit=True)
    assert got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < 2e-3
    assert ((state - want_state).norm() / want_state.norm()).item() < 2e-3
