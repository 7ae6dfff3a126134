"""Qwen3.6-27B's weight matrix products alone, against the bf16 rate floor: how far cuBLAS is from it
at the verify widths, and whether the residual add, the weight layout or the width changes that.

    python benchmarks/projection_gemms.py [--part epilogue,layout,widths] [--shape qwen3.6-27b]

Random bf16 operands at the model's sizes (hidden 5120, MLP 17408, 6144-wide GDN / attention output
projections), one GPU. Each time is the median of CUDA graph replays of 20 back-to-back calls. The
floor ("ideal") is 2 x rows x K x N / the rate of an 8192^3 product measured in the same run (and,
in ``layout``, at least the weight read at 4.2 TB/s). Parts:
- ``epilogue``: the residual sum in the product's epilogue into a new tensor (``torch.addmm``, which
  first copies the residual there) and in place (``addmm_``, what the fused layers do), a plain
  product, and each followed by the next RMS norm (the project's ``one_plus_rms_norm``; an add + norm
  kernel after the plain product), for the output projections down_proj and o_proj;
- ``layout``: the weight as a Linear stores it ([N, K], "TN") or transposed in memory ("NN", still a
  [N, K] view), for every projection, with and without the residual add;
- ``widths``: down_proj and gate/up at widths around 256 and 1024 (what padding a pass would buy);
- ``split``: each projection at 257 rows as one product and as two over rows [0, a) and [a, 257)
  (each reading the whole weight: what splitting a DDTree B = 256 pass's products would buy).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from forward_anatomy import replay_us  # a sibling script: benchmarks/ is on sys.path

from workers.models.fused_hybrid_triton import one_plus_rms_norm
from workers.models.shapes import target_config

HIDDEN, MLP, HEADS_OUT = 5120, 17408, 6144  # Qwen3.6-27B's; ``--shape`` sets another model's


@triton.jit
def _add_norm_kernel(X, R, W, SUM, OUT, n, eps, BLOCK: tl.constexpr):
    """SUM = X + R rounded to the model dtype (transformers' residual add), OUT = its (1 + w) RMS norm."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < n
    total = (tl.load(X + row * n + cols, mask=valid, other=0.0).to(tl.float32)
             + tl.load(R + row * n + cols, mask=valid, other=0.0).to(tl.float32)).to(SUM.dtype.element_ty)
    tl.store(SUM + row * n + cols, total, mask=valid)
    x = total.to(tl.float32)
    w = tl.load(W + cols, mask=valid, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps) * (1.0 + w)
    tl.store(OUT + row * n + cols, y.to(OUT.dtype.element_ty), mask=valid)


def epilogue_table(rate: float) -> None:
    norm_weight = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.1
    print(f"{'projection':>10} {'q':>5} {'addmm':>8} {'addmm_':>8} {'mm':>8} {'addmm+norm':>11} {'mm+addnorm':>11} "
          f"{'ideal':>8}   (us per call)")
    for q in (1, 17, 65, 257, 1025):
        for name, k in (("down", MLP), ("o", HEADS_OUT)):
            weight = torch.randn(HIDDEN, k, device="cuda", dtype=torch.bfloat16) * 0.01
            x = torch.randn(q, k, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn(q, HIDDEN, device="cuda", dtype=torch.bfloat16)
            total, normed = torch.empty_like(residual), torch.empty_like(residual)
            times = (
                replay_us(lambda: torch.addmm(residual, x, weight.t())),
                replay_us(lambda: total.addmm_(x, weight.t())),
                replay_us(lambda: torch.mm(x, weight.t())),
                replay_us(lambda: one_plus_rms_norm(torch.addmm(residual, x, weight.t()), norm_weight, 1e-6)),
                replay_us(lambda: _add_norm_kernel[(q,)](torch.mm(x, weight.t()), residual, norm_weight, total,
                                                         normed, HIDDEN, 1e-6, BLOCK=triton.next_power_of_2(HIDDEN),
                                                         num_warps=16)),  # the project's norm's launch
            )
            ideal = 2 * q * k * HIDDEN / rate * 1e6
            print(f"{name:>10} {q:>5} " + " ".join(f"{t:8.1f}" for t in times[:3])
                  + f" {times[3]:11.1f} {times[4]:11.1f} {ideal:8.1f}")


def layout_table(rate: float) -> None:
    weights = {"gate_up": (2 * MLP, HIDDEN), "down": (HIDDEN, MLP), "o_gdn": (HIDDEN, HEADS_OUT),
               "qkvz": (16384, HIDDEN), "attn_qkv": (14336, HIDDEN), "lm_head": (248320, HIDDEN)}
    print(f"{'weight':>9} {'q':>5} {'TN us':>8} {'NN us':>8} {'TN add':>8} {'NN add':>8} {'ideal':>8}  NN/TN  equal")
    for name, (n, k) in weights.items():
        stored = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.01  # [N, K], as a Linear holds it
        transposed = stored.t().contiguous().t()  # [N, K] view of a [K, N] buffer
        for q in (1, 17, 257, 1025):
            if name == "lm_head" and q > 257:
                continue
            x = torch.randn(q, k, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn(q, n, device="cuda", dtype=torch.bfloat16)
            calls = {"TN": lambda: torch.mm(x, stored.t()), "NN": lambda: torch.mm(x, transposed.t())}
            if name in ("down", "o_gdn"):
                calls |= {"TN add": lambda: torch.addmm(residual, x, stored.t()),
                          "NN add": lambda: torch.addmm(residual, x, transposed.t())}
            best: dict[str, float] = {}
            for _ in range(3):  # interleaved, the best of three: the GPU's clock drifts as it heats
                for key, fn in calls.items():
                    best[key] = min(best.get(key, float("inf")), replay_us(fn))
            equal = torch.equal(torch.mm(x, stored.t()), torch.mm(x, transposed.t()))
            ideal = max(2 * q * k * n / rate, 2 * n * k / 4.2e12) * 1e6
            print(f"{name:>9} {q:>5} {best['TN']:8.1f} {best['NN']:8.1f} {best.get('TN add', float('nan')):8.1f} "
                  f"{best.get('NN add', float('nan')):8.1f} {ideal:8.1f}  {best['NN'] / best['TN']:.3f}  {equal}")


def widths_table(rate: float) -> None:
    down = torch.randn(HIDDEN, MLP, device="cuda", dtype=torch.bfloat16) * 0.01
    gate_up = torch.randn(2 * MLP, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.01
    print(f"{'q':>5} {'down addmm':>11} {'down mm':>8} {'gate/up mm':>11}   (x the rate floor)")
    for q in (256, 257, 264, 272, 288, 320, 1024, 1025, 1032, 1088):
        x, residual = torch.randn(q, MLP, device="cuda", dtype=torch.bfloat16), torch.randn(
            q, HIDDEN, device="cuda", dtype=torch.bfloat16)
        mlp_floor = 2 * q * MLP * HIDDEN / rate * 1e6
        ratios = [replay_us(lambda: torch.addmm(residual, x, down.t())) / mlp_floor,
                  replay_us(lambda: torch.mm(x, down.t())) / mlp_floor]
        x = torch.randn(q, HIDDEN, device="cuda", dtype=torch.bfloat16)
        ratios.append(replay_us(lambda: torch.mm(x, gate_up.t())) / (2 * mlp_floor))
        print(f"{q:>5} {ratios[0]:10.2f}x {ratios[1]:7.2f}x {ratios[2]:10.2f}x")


def split_table(rate: float) -> None:
    weights = {"gate_up": (2 * MLP, HIDDEN), "down": (HIDDEN, MLP), "o_gdn": (HIDDEN, HEADS_OUT),
               "qkvz": (16384, HIDDEN), "attn_qkv": (14336, HIDDEN)}
    cuts = (128, 129, 136, 144, 176, 192, 240)
    print(f"{'weight':>9} {'one':>7} " + " ".join(f"{f'{a}+{257 - a}':>8}" for a in cuts) + f" {'ideal':>7}"
          "   (us per 257 rows)")
    for name, (n, k) in weights.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.01
        x = torch.randn(257, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(257, n, device="cuda", dtype=torch.bfloat16)
        cells = [replay_us(lambda: torch.mm(x, weight.t(), out=out))]
        for a in cuts:
            cells.append(replay_us(lambda a=a: (torch.mm(x[:a], weight.t(), out=out[:a]),
                                                torch.mm(x[a:], weight.t(), out=out[a:]))))
        ideal = 2 * 257 * n * k / rate * 1e6
        print(f"{name:>9} " + " ".join(f"{c:7.1f}" for c in cells[:1]) + " " + " ".join(f"{c:8.1f}" for c in cells[1:])
              + f" {ideal:7.1f}")


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="epilogue,layout,widths,split")
    parser.add_argument("--shape", default="qwen3.6-27b", help="the model whose projection sizes are timed")
    args = parser.parse_args()
    global HIDDEN, MLP, HEADS_OUT
    config = target_config(args.shape)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    HIDDEN, MLP, HEADS_OUT = config.hidden_size, config.intermediate_size, config.num_attention_heads * head_dim
    torch.manual_seed(0)
    square = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    rate = 2 * 8192**3 / (replay_us(lambda: square @ square, 5, 5) / 1e6)
    print(f"{torch.cuda.get_device_name()}: bf16 8192^3 product {rate / 1e12:.0f} TFLOP/s")
    tables = {"epilogue": epilogue_table, "layout": layout_table, "widths": widths_table, "split": split_table}
    for part in args.part.split(","):
        print(f"-- {part}")
        tables[part](rate)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
