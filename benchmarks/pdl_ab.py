"""Programmatic dependent launch off and on in one process: the target's graph-replayed passes, taking
turns, so the GPU's clock and the chosen cuBLASLt algorithms are the same for all.

    python benchmarks/pdl_ab.py [--shape qwen3.6-27b] [--qs 1,17,257] [--reps 30]

Three ``StaticTarget``s over one random-weight model (bf16, one GPU) capture their graphs with the
Triton kernels launched without PDL, with PDL waiting only, and with PDL waiting and then releasing the
next kernel (``workers.models.pdl_triton``), every pass inside ``kernels.dependent_launches``. Per
pass width q (1: AR's step, ``advance``; 17: a DFlash chain; more: a DDTree tree of q rows) each
target loads its inputs and captures once; then, ``--reps`` times, each replays its graph alone (timed
by CUDA events) and runs the whole call (the inputs' copies, the replay; host clock to a
synchronisation). Prints per row the median and quartiles of each, and the ratios of the medians to
no PDL; per width, the SM clock and board power (nvidia-smi) just after its timings (a lower clock
under seconds of compute-bound replays makes its wide passes slower than ``gpu_speed.py``'s short runs
time them: ``sustained.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gpu_speed import random_tree  # sibling scripts: benchmarks/ is on sys.path
from sustained import clock_and_power

from workers.models import lt_product, pdl_triton
from workers.models.kernels import dependent_launches
from workers.models.runner.target import StaticTarget
from workers.models.shapes import build_random_drafter, build_random_target


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    low, mid, high = statistics.quantiles(samples, n=4)
    return low, mid, high


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.6-27b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--qs", default="1,17,257")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda")
    qs = [int(q) for q in args.qs.split(",")]
    with torch.inference_mode(), lt_product.choosing():
        model = build_random_target(args.shape, torch.bfloat16, device)
        taps = build_random_drafter(args.shape, model).spec.target_layer_ids
        prompt = torch.randint(1, model.config.vocab_size - 1, (1, args.context), device=device)
        modes = {"off": 0, "wait": pdl_triton.WAIT, "release": pdl_triton.WAIT_AND_RELEASE}
        targets = {label: StaticTarget(model, taps, graphs=True) for label in modes}
        enabled = pdl_triton._enabled
        with dependent_launches(True):
            print(f"{args.shape}, context {args.context}; PDL mode on this GPU: {pdl_triton.launch_options(device)}")
        print(f"{'q':>5} {'way':>6} " + " ".join(f"{label + ' ms (q1 med q3)':>24}" for label in modes)
              + " " + " ".join(f"{label + '/off':>11}" for label in modes if modes[label]))
        for q in qs:
            tree = random_tree(model.config.vocab_size, q).to(device) if q > 17 else None
            chain = prompt[0, :q]
            calls, replays = {}, {}
            for label, target in targets.items():
                pdl_triton._enabled = enabled if modes[label] else (lambda device_index: False)
                pdl_triton.MODE = modes[label]
                target.start(capacity=args.context + 600, max_verify=max(qs))
                target.prefill(prompt)
                if q == 1:
                    calls[label] = lambda t=target: t.advance(chain)
                    replays[label] = lambda t=target: t.advance_graphs.replay(1)
                elif tree is None:
                    calls[label] = lambda t=target: t.verify_chain(chain)
                    replays[label] = lambda t=target: t.verify_graphs.replay(t._replayed)
                else:
                    calls[label] = lambda t=target: t.verify_tree(prompt[0, 0], tree)
                    replays[label] = lambda t=target: t.verify_graphs.replay(t._replayed)
                with dependent_launches(True):
                    calls[label]()  # captures with this launch setting
                calls[label]()
            pdl_triton._enabled = enabled
            torch.cuda.synchronize()
            replay_ms = {label: [] for label in targets}
            call_ms = {label: [] for label in targets}
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(args.reps):
                for label in targets:
                    calls[label]()  # loads this target's inputs (and, for AR, its committed length)
                    torch.cuda.synchronize()
                    begin.record()
                    replays[label]()
                    end.record()
                    end.synchronize()
                    replay_ms[label].append(begin.elapsed_time(end))
                    start = time.perf_counter()
                    calls[label]()
                    torch.cuda.synchronize()
                    call_ms[label].append((time.perf_counter() - start) * 1e3)
            print(f"      SM clock, board power after the {q}-row timings: {clock_and_power()}")
            for way, samples in (("replay", replay_ms), ("call", call_ms)):
                spreads = {label: quartiles(samples[label]) for label in modes}
                print(f"{q:>5} {way:>6} " + " ".join(f"{low:>8.3f} {mid:>7.3f} {high:>7.3f}"
                                                    for low, mid, high in spreads.values())
                      + " " + " ".join(f"{spreads[label][1] / spreads['off'][1]:>11.4f}"
                                       for label in modes if modes[label]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
