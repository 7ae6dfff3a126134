"""Where the GPU waits during decoding rounds: idle gaps between kernels, by the stage that ends them.

    python benchmarks/round_gaps.py [--shape qwen3-8b] [--budget 64] [--method ddtree] [--in-line]

Random weights of a named shape in bf16 on one GPU, CUDA graphs on, a short prompt (so the prefill
is small) and 96 new tokens. The generation runs once to capture every graph, then again under
torch.profiler with each engine stage annotated (``record_function``, no synchronisation). Prints
the decode wall time per round, the GPU's busy time per round (some kernel running, on any stream),
the host's own time in each stage (a third run, untraced, timed by the host's clock; the commit's wait
for the round's read and what it does after that apart), the idle gaps (no kernel running on any
stream) summed by the stage whose launch ended them, the part of them before the host began that launch
(the GPU waiting for the host; the rest is the launch's latency or a wait on another stream; the
profiler slows each launch, so this part is an upper bound), the idle each time a stage opened as
quantiles (a few stalls of the profiler's can make a sum look like a steady wait), and the kernel time
each stage launched, all over the rounds alone (the prompt's kernels, launched before any stage, are
left out; the speculative engines' first draft, over the prompt's context, is "opening draft").
Last, untraced, the verify graph's replays back to back and each after its input copies: a wait the
trace shows between the two that the GPU pays untraced lengthens the second.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from workers.decoding import generation
from workers.decoding.generation import GenerationConfig
from workers.decoding.methods import entry
from workers.metrics import quantile
from workers.models.runner.target import StaticTarget
from workers.models.shapes import build_random_drafter, build_random_target

OPENING_DRAFT = "opening draft"  # the name both timings give the engines' first draft, once a generation


class AnnotatingTimer:
    """The engines' timer interface: marks each stage in the profiler trace, adds no sync."""

    totals: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        with record_function(f"stage:{name}"):
            yield


class HostTimer:
    """The engines' timer interface: sums the host's own time in each stage (no sync, no profiler). The
    commit stage's includes its wait for the round's one host read; inside ``reads_timed()`` that wait is
    also summed alone ("read wait"), and so is the host's time from the read's return to the end of its
    commit stage ("commit after the read": the commit's queueing, which with the next round's tree and
    verify stages is all the host does before the verify's launch, while the GPU runs the draft). One
    generation a timer: a first stage named "draft" is summed as "opening draft" (``gaps_by_stage``'s)."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self._read_returned: float | None = None

    @contextmanager
    def stage(self, name: str):
        if not self.totals and name == "draft":
            name = OPENING_DRAFT
        begin = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.totals[name] += end - begin
            if name == "commit" and self._read_returned is not None:
                self.totals["commit after the read"] += end - self._read_returned
                self._read_returned = None

    @contextmanager
    def reads_timed(self):
        """Inside: every ``generation.ReadLater`` read (the engines' one wait a round) is timed."""
        untimed = generation.ReadLater.__call__

        def timed(read):
            begin = time.perf_counter()
            try:
                return untimed(read)
            finally:
                self._read_returned = time.perf_counter()
                self.totals["read wait"] += self._read_returned - begin

        generation.ReadLater.__call__ = timed
        try:
            yield
        finally:
            generation.ReadLater.__call__ = untimed


@dataclass
class Gaps:
    """A traced run's rounds: the GPU's busy time and span (us), and by the stage that launched them (see
    ``gaps_by_stage``) the gaps, their host-late part, and the kernels' own time."""

    busy: float  # time some kernel ran, on any stream
    span: float  # the first round kernel's start to the last kernel's end
    gaps: dict[str, list[float]]  # stage -> each gap (no kernel running) before one of its kernels
    late: dict[str, float]  # stage -> the part of its gaps before the host began the launch
    work: dict[str, float]  # stage -> its kernels' summed durations
    before: dict[tuple[str, str], list[float]]  # (stage, kernel name) -> the gaps before that kernel
    # stage -> the idle charged to each time the stage opened (zeros too): a steady wait and a few long
    # ones (a profiler's stall) can sum alike, and differ here
    per_opening: dict[str, list[float]]


def gaps_by_stage(trace: dict, min_gap_us: float = 2.0) -> Gaps:
    """The rounds' ``Gaps`` from a chrome trace: each kernel, and the gap before it, is charged to the
    annotated stage that was open on the host when that kernel was launched (a graph's kernels to the stage
    that launched the graph). Kernels launched before the first stage opened are the prompt's (its prefill
    and first token) and are left out, so the sums are the rounds' alone; the span starts at the first
    round's first kernel. Kernels on several streams overlap (a commit beside the draft, its branches):
    busy is the time some kernel ran, and a gap is time none ran (not the time since the kernel that
    started last ended), while a stage's kernel time sums its kernels' own. A gap's host-late part runs
    from the GPU going idle to the host beginning that kernel's launch call (a graph's: the graph's): the
    GPU waited for the host; the rest of the gap, the launch's own latency or a wait on another stream,
    was the device's. Each stage's idle is also kept per opening of the stage (its quantiles tell a steady
    wait from a few long ones). The speculative engines' first draft, before their first round (over the
    prompt's context, once a generation), is its own stage, "opening draft"."""
    events = trace["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    stages = sorted(((e["ts"], e["ts"] + e["dur"], e["name"][6:]) for e in events
                     if e.get("cat") == "user_annotation" and e["name"].startswith("stage:")))
    if stages and stages[0][2] == "draft":  # the engines' first draft reads the prompt's context: once
        stages[0] = (*stages[0][:2], OPENING_DRAFT)

    def opening_at(ts: float) -> int | None:
        for index, (begin, end, _) in enumerate(stages):
            if begin <= ts <= end:
                return index
        return None

    rounds_begin = stages[0][0] if stages else float("-inf")
    out = Gaps(0.0, 0.0, defaultdict(list), defaultdict(float), defaultdict(float), defaultdict(list), {})
    idle_by_opening = [0.0] * len(stages)
    first = None
    ran_until = kernels[0]["ts"] + kernels[0]["dur"] if kernels else 0.0  # the latest end of a kernel so far
    for kernel in kernels[1:]:
        begin, end = kernel["ts"], kernel["ts"] + kernel["dur"]
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is not None and launch["ts"] < rounds_begin:
            ran_until = max(ran_until, end)
            continue  # the prompt's
        first = kernel if first is None else first
        out.busy += max(0.0, end - max(begin, ran_until))
        opening = opening_at(launch["ts"]) if launch else None
        stage = stages[opening][2] if opening is not None else "between stages" if launch else "unknown"
        out.work[stage] += kernel["dur"]
        gap = begin - ran_until
        if gap >= min_gap_us and first is not kernel:  # (the first round kernel's gap follows the prompt)
            out.gaps[stage].append(gap)
            out.before[stage, kernel["name"][:60]].append(gap)
            if launch is not None:
                out.late[stage] += min(gap, max(0.0, launch["ts"] - ran_until))
            if opening is not None:
                idle_by_opening[opening] += gap
        ran_until = max(ran_until, end)
    out.span = ran_until - first["ts"] if first is not None else 0.0
    for (_, _, name), idle in zip(stages, idle_by_opening):
        out.per_opening.setdefault(name, []).append(idle)
    return out


def verify_replays_ms(target: StaticTarget, batches: int = 7, replays: int = 40) -> dict[str, list[float]]:
    """The last verify pass's graph replayed untraced, ``replays`` a batch timed by CUDA events, the batches
    of each form interleaved: back to back, and each replay after the pass's input copies (``load_verify``,
    as a round runs them). A wait the profiler shows between those copies and the graph's first kernel
    costs the difference. Empty when no verify graph was replayed (AR)."""
    keys = target.verify_graphs.cache.keys()
    if not keys:
        return {}
    q = keys[-1][0]  # the most recently replayed pass's width
    graph, state = target.verify_graphs.cache[keys[-1]][0], target.state
    inputs = (state.ids[:q].clone(), state.depths[:q].clone(), state.parents[:q].clone(),
              state.visible[:q, :q].clone())
    forms = {"back to back": lambda: None,
             "after its input copies": lambda: state.load_verify(*inputs, chain=False)}
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(batches):
        for name, before in forms.items():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                before()
                graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / replays)
    return times


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
    lines = [f"{'case':>14} {'rounds':>6} {'wall ms/round':>13} {'GPU busy ms/round':>17} {'idle ms/round':>13}  "
             "idle by stage (ms/round)"]
    for name, engine, params in cases:
        run = lambda e=engine, p=params, t=None: e(target, drafter if p else None, prompt, config, p,  # noqa: E731
                                                   **({"timer": t} if t else {}))
        run()  # captures every graph this case needs
        begin = time.perf_counter()
        out = run()
        wall_ms = (time.perf_counter() - begin) * 1e3
        host = HostTimer()
        with host.reads_timed():
            hosted = run(t=host)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            traced = run(t=AnnotatingTimer())
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "trace.json"
            prof.export_chrome_trace(str(path))
            traced_gaps = gaps_by_stage(json.loads(path.read_text()))
        rounds = traced.num_rounds
        idle = sum(sum(v) for v in traced_gaps.gaps.values())
        by_stage = ", ".join(f"{stage} {sum(v) / 1e3 / rounds:.2f} ({len(v)})" for stage, v in
                             sorted(traced_gaps.gaps.items(), key=lambda kv: -sum(kv[1])))
        lines.append(f"{name:>14} {out.num_rounds:>6} {out.decode_s * 1e3 / out.num_rounds:>13.2f} "
                     f"{traced_gaps.busy / 1e3 / rounds:>17.2f} {idle / 1e3 / rounds:>13.2f}  {by_stage}")
        lines.append(f"{'':>14} of the idle, the host late (its launch begun after the GPU went idle; ms/round): "
                     + ", ".join(f"{stage} {traced_gaps.late[stage] / 1e3 / rounds:.2f}" for stage, v in
                                 sorted(traced_gaps.gaps.items(), key=lambda kv: -sum(kv[1]))))
        lines.append(f"{'':>14} idle each time a stage opened, median / 90th percentile / most (us): " + ", ".join(
            f"{stage} {quantile(v, 0.5):.1f} / {quantile(v, 0.9):.1f} / {max(v):.1f}" for stage, v in
            sorted(traced_gaps.per_opening.items(), key=lambda kv: -sum(kv[1]))))
        lines.append(f"{'':>14} kernels by stage (ms/round): " + ", ".join(
            f"{stage} {us / 1e3 / rounds:.2f}" for stage, us in
            sorted(traced_gaps.work.items(), key=lambda kv: -kv[1])))
        lines.append(f"{'':>14} the kernels the GPU waited for most (ms/round, gaps/round): " + "; ".join(
            f"{stage}: {name} {sum(v) / 1e3 / rounds:.3f} ({len(v) / rounds:.1f})" for (stage, name), v in
            sorted(traced_gaps.before.items(), key=lambda kv: -sum(kv[1]))[:8]))
        lines.append(f"{'':>14} the host's time in each stage, untraced (ms/round): " + ", ".join(
            f"{stage} {seconds * 1e3 / hosted.num_rounds:.2f}" for stage, seconds in
            sorted(host.totals.items(), key=lambda kv: -kv[1])) + " (commit: with the read wait)")
        lines.append(f"{'':>14} (whole call {wall_ms:.1f} ms untraced; traced kernel span "
                     f"{traced_gaps.span / 1e3:.1f} ms after the prompt)")
        replays = verify_replays_ms(target)
        if replays:
            lines.append(f"{'':>14} the verify graph replayed untraced, ms (median, min-max of 7 x 40): " + ", ".join(
                f"{form} {quantile(v, 0.5):.3f} ({min(v):.3f}-{max(v):.3f})" for form, v in replays.items()))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
