"""The drafter's fused capturable pass (``workers.models.fused_drafter``) against its op-by-op pass.

On the CPU in float32 the two agree to rounding (the reference tests of ``test_drafter_attention.py``
and ``test_drafter_static.py`` run the fused pass too, since ``forward_at`` takes it by default). On
a GPU in bfloat16 the fused pass runs the Triton kernels (the heads kernel, the attention reading
the mask from slot 0 for the sliding layers); it must stay as close to the float32 pass as the
op-by-op bfloat16 pass does, as the context grows past the windows.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.workers.models.test_drafter_attention import CASES, drafter_for, inputs

ROUNDS = (9, 1, 4, 2, 6, 1, 5, 3)  # a prompt of 9, then rounds committing 1..6 tokens


def passes(drafter, taps: torch.Tensor, block_embeds: torch.Tensor, fused: bool) -> list[torch.Tensor]:
    """``forward_at``'s block hidden states [b, H] round after round, over one cache."""
    cache, length, out = drafter.new_cache(64), 0, []
    for new in ROUNDS:
        context = taps[None, length : length + new]
        out.append(drafter.forward_at(block_embeds[None], context, cache, torch.tensor(length, device=taps.device),
                                      fused=fused)[0])
        cache.length = length = length + new
    return out


@torch.no_grad()
def test_fused_pass_equals_the_op_by_op_pass_on_the_cpu():
    layers, change, _ = CASES["Qwen3.6-27B layout"]
    drafter = drafter_for(layers, change)
    assert drafter.fused_layers() is not None  # the default pass is the fused one
    taps, block_embeds = inputs(drafter, sum(ROUNDS))
    for got, want in zip(passes(drafter, taps, block_embeds, True), passes(drafter, taps, block_embeds, False)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_dflash2_layers_keep_the_op_by_op_pass(tiny_dflash2):
    assert tiny_dflash2.drafter.fused_layers() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["plain DFlash", "Qwen3.6-27B layout", "window inside the block",
                                  "causal override on"])
@torch.no_grad()
def test_fused_pass_in_bfloat16_is_as_close_to_float32_as_the_op_by_op_pass(case, monkeypatch):
    from workers.models import attention_triton

    kernel_calls = []
    real = attention_triton.attend_until
    monkeypatch.setattr(attention_triton, "attend_until",  # counted, then run as it is
                        lambda *args, **kwargs: kernel_calls.append(1) or real(*args, **kwargs))
    layers, change, _ = CASES[case]
    exact = drafter_for(layers, change | {"head_dim": 64}).cuda()  # a head size the Triton attention takes
    taps, block_embeds = (t.cuda() for t in inputs(exact, sum(ROUNDS)))
    half = copy.deepcopy(exact).to(torch.bfloat16)
    want = passes(exact, taps, block_embeds, fused=False)
    fused = passes(half, taps.bfloat16(), block_embeds.bfloat16(), fused=True)
    assert len(kernel_calls) == len(ROUNDS) * layers, "the fused pass did not run the Triton attention"
    op_by_op = passes(half, taps.bfloat16(), block_embeds.bfloat16(), fused=False)
    for index, (w, f, o) in enumerate(zip(want, fused, op_by_op)):
        assert torch.isfinite(f).all()
        fused_error = (f.float() - w).abs().max().item()
        op_error = (o.float() - w).abs().max().item()
        assert fused_error <= 2 * op_error + 1e-2 * w.abs().max().item(), (index, fused_error, op_error)
