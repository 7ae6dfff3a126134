"""The hybrid targets' Triton kernels against their torch forms on a machine with no GPU, through
Triton's interpreter (for sessions without one; the GPU tests remain the proof on hardware).

    TRITON_INTERPRET=1 python benchmarks/interpreted_kernels.py

Needs ``triton`` installed (no CUDA). The interpreter runs the kernels' Python on CPU tensors, in
float32 and float16 (it has no bfloat16), at small head sizes. Printed per check: the largest
relative error against the torch form (float32: ~1e-7 expected). With numpy 2.4.6 Triton 3.6's
interpreter fails on a loop whose bounds were loaded from memory (``int()`` of a one-element array,
in ``runtime/interpreter.py``'s ``tensor.__index__``); reading ``.reshape(-1)[0]`` there fixes it.
"""

from __future__ import annotations

import os

import torch

from workers.models import attention_triton
from workers.models.attention import attend_folded
from workers.models.deltanet import TreeShape, ancestor_table, l2_normalize, tree_delta_rule
from workers.models.gdn_layer import gdn_layer_for
from workers.models.gdn_triton import gated_norm, tree_outputs
from workers.models.kernel_inputs import attention_pass_inputs, random_tree_parents
from workers.models.shapes import build_random_target


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def tree_checks(lines: list[str]) -> None:
    """tree_outputs (the blocked solve with its state products), with and without the gated norm in its epilogue."""
    for q, depth, dk, dv in [(1, 1, 16, 16), (17, 15, 32, 32), (70, 15, 32, 16), (300, 6, 16, 32)]:
        g = torch.Generator().manual_seed(q)
        hk, h = 2, 6
        parents = random_tree_parents(q, depth, g)
        query, key = torch.randn(q, hk, dk, generator=g), torch.randn(q, hk, dk, generator=g)
        value, log_gate = torch.randn(q, h, dv, generator=g), -torch.rand(q, h, generator=g) * 2
        beta, state = torch.rand(q, h, generator=g), torch.randn(h, dk, dv, generator=g) * 0.3
        ancestors = ancestor_table(parents)
        want = tree_delta_rule(query, key, value, log_gate, beta, state, ancestors, use_triton=False)
        kq = torch.stack((l2_normalize(key).transpose(0, 1), (l2_normalize(query) * dk**-0.5).transpose(0, 1)), 1)
        v_ = value.transpose(0, 1).contiguous()
        got = tree_outputs(kq, v_, log_gate, beta, state, ancestors)
        z = torch.randn(q, h * dv + 5, generator=g)[:, 2 : 2 + h * dv]
        weight = 1 + 0.1 * torch.randn(dv, generator=g)
        normed = tree_outputs(kq, v_, log_gate, beta, state, ancestors, norm=(z, weight, 1e-6))
        lines.append(f"tree q={q:<4} depth {depth:>2}: outputs {relative(got, want):.1e}, with the gated norm "
                     f"{relative(normed, gated_norm(want, z, weight, 1e-6, torch.float32)):.1e}")


def attention_checks(lines: list[str]) -> None:
    """attend_until (keys up to the last slot, the mask over the pass's own keys) against SDPA."""
    for heads, groups, q, capacity, length, dim in [(2, 3, 30, 200, 100, 32), (1, 4, 129, 1300, 1024, 32),
                                                    (2, 1, 257, 700, 0, 16)]:
        query, key, value, mask, slots = attention_pass_inputs(heads, groups, q, capacity, length, dim,
                                                               torch.float16, q, "cpu")
        end = length + q
        want = attend_folded(query.float(), key[:, :end].float(), value[:, :end].float(), mask[:, :end].float(),
                             dim**-0.5)
        errors = [relative(attention_triton.attend_until(query, key, value, mask, slots, dim**-0.5, splits), want)
                  for splits in (1, 3, 8)]
        lines.append(f"attention q={q:<4} past {length:>4}: splits 1/3/8 " + " ".join(f"{e:.1e}" for e in errors)
                     + " (float16)")


def layer_checks(lines: list[str]) -> None:
    """A whole GDN layer through the kernels (prologue, tree or chain, norm) against its torch path."""
    model = build_random_target("qwen3.6-mini", torch.float32, torch.device("cpu"))
    layer = gdn_layer_for(model.model.layers[0].linear_attn)
    for chain, q in [(False, 40), (False, 130), (True, 40), (True, 1), (True, 7)]:
        g = torch.Generator().manual_seed(q)
        hidden = torch.randn(1, q, model.config.hidden_size, generator=g)
        parents = torch.arange(-1, q - 1) if chain else random_tree_parents(q, 15, g)
        shape = TreeShape.build(parents, layer.window, chain, commits=chain).with_blocks()
        window = torch.randn(layer.window, layer.conv_dim, generator=g)
        state = torch.randn(layer.state_shape, generator=g) * 0.3
        results = []
        for kernels in (False, True):
            layer.kernels = kernels
            w, s = window.clone(), state.clone()
            out, _ = layer(hidden, shape, w, s, commit=chain)
            results.append((out, s, w))
        (want, want_state, want_window), (got, got_state, got_window) = results
        kept = f", state {relative(got_state, want_state):.1e}, window equal {torch.equal(got_window, want_window)}"
        lines.append(f"GDN layer {'chain' if chain else 'tree'} q={q:<4}: outputs {relative(got, want):.1e}"
                     + (kept if chain else ""))


@torch.inference_mode()
def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (the kernels then run on CPU tensors)")
    lines: list[str] = []
    for check in (tree_checks, attention_checks, layer_checks):
        check(lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
