"""The floors and the verify passes in a burst and under sustained load, in one process.

    python benchmarks/sustained.py [--shape qwen3.6-27b] [--qs 17,257] [--seconds 5]
        [--attention-form splits|shared|chosen]

A GPU at its power limit lowers its SM clock within a second of compute-bound work, so a pass timed
in a few calls after idle (``gpu_speed.py``) runs at another clock than the same pass deep in a decode
run, and so does the 8192^3 product that gives the compute floor. Here each of: the bf16 product, the
4 GiB copy (the weight floor's bandwidth) and each verify pass (17 rows: a chain; more: a tree; graph
replays), after 3 s idle, runs back to back for ``--seconds``, each call timed by CUDA events. Burst:
the median of the calls in the first 0.25 s; sustained: of those in the last second. The SM clock
and board power come from nvidia-smi right after each run. Each pass is printed against
max(weight floor, compute floor) measured in the same regime, then what ``lt_product`` chose per
product shape when the passes were captured, and (``--attention-form chosen``) the attention's form per
pass shape with its trial's times.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch
from gpu_speed import lt_lines, model_sizes, random_tree  # a sibling script: benchmarks/ is on sys.path

from workers.models import attention_triton
from workers.models.gdn import MAX_PATH
from workers.models.runner.target import StaticTarget
from workers.models.shapes import build_random_drafter, build_random_target

BURST_S = 0.25  # the first calls after idle
LAST_S = 1.0  # the sustained window: the run's last second
IDLE_S = 3.0  # before each run, so every burst starts from the same idle clock


def clock_and_power() -> str:
    """nvidia-smi's SM clock and board power (its last sample), or why they are not known."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or done.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__})"


def spread(samples: list[float]) -> str:
    """The samples' count and quartiles (ms): what a median printed beside it rests on."""
    low, high = statistics.quantiles(samples, n=4)[::2] if len(samples) > 1 else (samples[0], samples[0])
    return f"{len(samples)} calls, quartiles {low:.3f}-{high:.3f}"


def burst_and_sustained(fn, seconds: float) -> tuple[float, float, str, str]:
    """(burst ms, sustained ms, clock and power after, both windows' spread) of ``fn`` called back to
    back for ``seconds``."""
    torch.cuda.synchronize()
    time.sleep(IDLE_S)
    probe = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    probe[0].record()
    fn()
    probe[1].record()
    probe[1].synchronize()
    calls = max(8, int(seconds * 1e3 / probe[0].elapsed_time(probe[1])))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for begin, end in events:
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    after = clock_and_power()
    times = [begin.elapsed_time(end) for begin, end in events]
    starts = [events[0][0].elapsed_time(begin) / 1e3 for begin, _ in events]  # s since the first call
    total = starts[-1] + times[-1] / 1e3
    burst = [t for t, s in zip(times, starts) if s < BURST_S] or times[:1]
    last = [t for t, s in zip(times, starts) if s >= total - LAST_S] or times[-1:]
    return (statistics.median(burst), statistics.median(last), after,
            f"burst {spread(burst)}; sustained {spread(last)}")


def hardware_runs(device: torch.device, seconds: float) -> dict[str, tuple[float, float, str, str]]:
    """The bf16 product's and the copy's runs (their buffers freed on return)."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    source = torch.empty(2**31, dtype=torch.int16, device=device)
    copy = torch.empty_like(source)
    return {"bf16 product 8192^3": burst_and_sustained(lambda: a @ b, seconds),
            "copy 4 GiB": burst_and_sustained(lambda: copy.copy_(source), seconds)}


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.6-27b")
    parser.add_argument("--qs", default="17,257", help="verify widths: 17 or fewer a chain, more a tree")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--attention-form", choices=sorted(attention_triton.FORMS),
                        help="the attention's work in key splits, shared among one round of programs, or chosen "
                             "per pass shape on trial (attention_triton.SHARED; default: as the module sets it)")
    args = parser.parse_args()
    if args.attention_form:
        attention_triton.SHARED = attention_triton.FORMS[args.attention_form]
    device = torch.device("cuda")
    model = build_random_target(args.shape, torch.bfloat16, device)
    drafter = build_random_drafter(args.shape, model)
    weight_bytes, matmul_params = model_sizes(model)
    qs = [int(q) for q in args.qs.split(",")]
    target = StaticTarget(model, drafter.spec.target_layer_ids, graphs=True)
    target.start(capacity=args.context + 600, max_verify=max(qs))
    prompt = torch.randint(1, model.config.vocab_size - 1, (1, args.context), device=device)
    target.prefill(prompt)

    rows = hardware_runs(device, args.seconds)
    rate = [2 * 8192**3 / (ms / 1e3) for ms in rows["bf16 product 8192^3"][:2]]  # FLOP/s: burst, sustained
    bandwidth = [2 * 2**31 * 2 / (ms / 1e3) for ms in rows["copy 4 GiB"][:2]]  # bytes/s read + written
    floors = {}
    for q in qs:
        if q <= 17:
            target.verify_chain(prompt[0, :q])
            key, label = (q, q > MAX_PATH), f"verify q={q} chain"  # the target's graph key (``_verify``)
        else:
            target.verify_tree(prompt[0, 0], random_tree(model.config.vocab_size, q).to(device))
            key, label = (q, False), f"verify q={q} tree"
        rows[label] = burst_and_sustained(lambda k=key: target.verify_graphs.replay(k), args.seconds)
        floors[label] = [max(weight_bytes / bw, 2 * matmul_params * q / r) * 1e3 for bw, r in zip(bandwidth, rate)]

    print(f"{args.shape}: {weight_bytes / 1e9:.1f} GB bf16 weights; each run {args.seconds:.0f} s back to back "
          f"after {IDLE_S:.0f} s idle; burst = its first {BURST_S} s, sustained = its last {LAST_S:.0f} s")
    print(f"{'':>22} {'burst ms':>9} {'sustained':>10} {'sust/burst':>10}  {'burst / floor':>14} "
          f"{'sustained / floor':>18}  clock, power after")
    for label, (burst, sustained, after, quartiles) in rows.items():
        against = ""
        if label in floors:
            floor_burst, floor_sustained = floors[label]
            against = f"{burst / floor_burst:>13.3f}x {sustained / floor_sustained:>17.3f}x"
        elif label.startswith("bf16"):
            against = f"{rate[0] / 1e12:>9.0f} TF/s {rate[1] / 1e12:>12.0f} TF/s"
        else:
            against = f"{bandwidth[0] / 1e12:>9.2f} TB/s {bandwidth[1] / 1e12:>12.2f} TB/s"
        print(f"{label:>22} {burst:>9.3f} {sustained:>10.3f} {sustained / burst:>10.3f}  {against}  {after}")
        print(f"{'':>22} {quartiles}")
    print("\n".join(lt_lines()) or "lt_product: no product shape timed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
