"""Where the GPU waits during decoding rounds: idle gaps between kernels, by the stage that ends them.

    python benchmarks/round_gaps.py [--shape qwen3-8b] [--budget 64] [--method ddtree] [--in-line]

Random weights of a named shape in bf16 on one GPU, CUDA graphs on, a short prompt (so the prefill
is small) and 96 new tokens. The generation runs once to capture every graph, then again under
torch.profiler with each engine stage annotated (``record_function``, no synchronisation). Prints
the decode wall time per round, the GPU's kernel time per round, the host's own time in each stage
(a third run, untraced, timed by the host's clock), and the idle gaps between
consecutive kernels summed by the stage whose launch ended them (the host work that stage did
before its first kernel is what the GPU waited for), and the kernel time each stage launched, all
over the rounds alone (the prompt's kernels, launched before any stage, are left out).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from workers.decoding import generation
from workers.decoding.generation import GenerationConfig
from workers.decoding.methods import entry
from workers.models.runner.target import StaticTarget
from workers.models.shapes import build_random_drafter, build_random_target


class AnnotatingTimer:
    """The engines' timer interface: marks each stage in the profiler trace, adds no sync."""

    totals: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        with record_function(f"stage:{name}"):
            yield


class HostTimer:
    """The engines' timer interface: sums the host's own time in each stage (no sync, no profiler). The
    commit stage's includes its wait for the round's one host read."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def stage(self, name: str):
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - begin


def gaps_by_stage(trace: dict, min_gap_us: float = 2.0) -> tuple[float, float, dict[str, list], dict[str, float], dict]:
    """(kernel time us, span us, {stage: [gap us...]}, {stage: kernel us}, {(stage, kernel after the gap):
    [gap us...]}) from a chrome trace: each kernel, and the gap before it, is charged to the annotated
    stage that was open on the host when that kernel was launched (a graph's kernels to the stage that
    launched the graph). Kernels launched before the first stage opened are the prompt's (its prefill and
    first token) and are left out, so the sums are the rounds' alone; the span starts at the first
    round's first kernel."""
    events = trace["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    stages = sorted(((e["ts"], e["ts"] + e["dur"], e["name"][6:]) for e in events
                     if e.get("cat") == "user_annotation" and e["name"].startswith("stage:")))

    def stage_at(ts: float) -> str:
        for begin, end, name in stages:
            if begin <= ts <= end:
                return name
        return "between stages"

    rounds_begin = stages[0][0] if stages else float("-inf")
    busy, gaps, work, before = 0.0, defaultdict(list), defaultdict(float), defaultdict(list)
    first = None
    for previous, kernel in zip(kernels, kernels[1:]):
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is not None and launch["ts"] < rounds_begin:
            continue  # the prompt's
        first = kernel if first is None else first
        busy += kernel["dur"]
        stage = stage_at(launch["ts"]) if launch else "unknown"
        work[stage] += kernel["dur"]
        gap = kernel["ts"] - (previous["ts"] + previous["dur"])
        if gap >= min_gap_us and first is not kernel:  # (the first round kernel's gap follows the prompt)
            gaps[stage].append(gap)
            before[stage, kernel["name"][:60]].append(gap)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - first["ts"] if first is not None else 0.0
    return busy, span, gaps, work, before


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--method", choices=("ar", "dflash", "ddtree"), default="ddtree")
    parser.add_argument("--budget", type=int, action="append", help="DDTree budget (repeatable; default 16, 64, 256)")
    parser.add_argument("--in-line", action="store_true",
                        help="each round's commit in line after the next draft, not beside it "
                             "(generation.COMMIT_BESIDE_DRAFT off)")
    args = parser.parse_args()
    if args.in_line:
        generation.COMMIT_BESIDE_DRAFT = False
    model = build_random_target(args.shape, torch.bfloat16, torch.device("cuda"))
    drafter = build_random_drafter(args.shape, model)
    target = StaticTarget(model, drafter.spec.target_layer_ids, graphs=True)
    prompt = torch.randint(1, model.config.vocab_size - 1, (1, 64), device="cuda")
    config = GenerationConfig(max_new_tokens=96)
    method = entry(args.method)
    knobs = method.params.knob_names()
    budgets = (args.budget or [16, 64, 256]) if "tree_budget" in knobs else [None]
    cases = [(f"{args.method}" + (f" B={b}" if b else ""), method.generate,
              method.params_from({"tree_budget": b} if b else {}) if method.needs_drafter else None)
             for b in budgets]
    lines = [f"{'case':>14} {'rounds':>6} {'wall ms/round':>13} {'kernels ms/round':>16} {'idle ms/round':>13}  "
             "idle by stage (ms/round)"]
    for name, engine, params in cases:
        run = lambda e=engine, p=params, t=None: e(target, drafter if p else None, prompt, config, p,  # noqa: E731
                                                   **({"timer": t} if t else {}))
        run()  # captures every graph this case needs
        begin = time.perf_counter()
        out = run()
        wall_ms = (time.perf_counter() - begin) * 1e3
        host = HostTimer()
        hosted = run(t=host)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            traced = run(t=AnnotatingTimer())
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "trace.json"
            prof.export_chrome_trace(str(path))
            busy, span, gaps, work, before = gaps_by_stage(json.loads(path.read_text()))
        rounds = traced.num_rounds
        idle = sum(sum(v) for v in gaps.values())
        by_stage = ", ".join(f"{stage} {sum(v) / 1e3 / rounds:.2f} ({len(v)})" for stage, v in
                             sorted(gaps.items(), key=lambda kv: -sum(kv[1])))
        lines.append(f"{name:>14} {out.num_rounds:>6} {out.decode_s * 1e3 / out.num_rounds:>13.2f} "
                     f"{busy / 1e3 / rounds:>16.2f} {idle / 1e3 / rounds:>13.2f}  {by_stage}")
        lines.append(f"{'':>14} kernels by stage (ms/round): " + ", ".join(
            f"{stage} {us / 1e3 / rounds:.2f}" for stage, us in sorted(work.items(), key=lambda kv: -kv[1])))
        lines.append(f"{'':>14} the kernels the GPU waited for most (ms/round, gaps/round): " + "; ".join(
            f"{stage}: {name} {sum(v) / 1e3 / rounds:.3f} ({len(v) / rounds:.1f})" for (stage, name), v in
            sorted(before.items(), key=lambda kv: -sum(kv[1]))[:8]))
        lines.append(f"{'':>14} the host's time in each stage, untraced (ms/round): " + ", ".join(
            f"{stage} {seconds * 1e3 / hosted.num_rounds:.2f}" for stage, seconds in
            sorted(host.totals.items(), key=lambda kv: -kv[1])) + " (commit: with the wait for the host read)")
        lines.append(f"{'':>14} (whole call {wall_ms:.1f} ms untraced; traced kernel span {span / 1e3:.1f} ms "
                     "after the prompt)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
