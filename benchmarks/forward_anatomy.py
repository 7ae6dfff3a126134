"""Where a graph-replayed target forward spends its GPU time, and what the matrix products alone cost.

    python benchmarks/forward_anatomy.py [--shape qwen3-8b] [--context 1024] [--compile]

Random weights of a named shape in bf16 on one GPU. Prints:
- the copy bandwidth (the floor's denominator);
- each weight shape's matrix product at q = 1 / 16 / 64 rows, replayed in a CUDA graph over one
  distinct weight per layer (so nothing is served from L2), as ms per forward and GB/s;
- kernel time of a graph-replayed verify pass (q = 1 and 64) by kind: matmul, attention, copies /
  indexing, reductions, other elementwise; and the top kernels;
- the same for the layers under torch.compile (``--compile``);
- the drafter pass: eager vs its CUDA graph; the tree build's graph at B = 16 and 256;
- whole DDTree generations (B = 16, 64, 256): wall time per round against GPU kernel time.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from gpu_speed import median_ms  # a sibling script: benchmarks/ is on sys.path
from torch.profiler import ProfilerActivity, profile

from workers.decoding import ddtree
from workers.decoding.drafting import EagerDrafting, open_drafting
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import TreeParams
from workers.models.runner.target import StaticTarget
from workers.models.shapes import build_random_drafter, build_random_target

KINDS = (
    ("matmul", ("gemv", "gemm", "nvjet", "cutlass", "sm90_", "xmma", "splitk", "_skinny_kernel", "_wide_kernel")),
    ("attention", ("fmha", "flash", "attention", "attn")),
    ("copy/index", ("index", "copy", "cat", "gather", "scatter", "fill")),
    ("reduction", ("reduce",)),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, needles in KINDS:
        if any(needle in lowered for needle in needles):
            return kind
    return "elementwise/other"


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up on a side stream); returns replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def replay_us(fn, calls: int = 20, reps: int = 7) -> float:
    """Median microseconds per call of ``calls`` calls captured in one CUDA graph (timed by events:
    back-to-back products of ~20 us, no host gap between them)."""
    replay = graphed(lambda: [fn() for _ in range(calls)])
    replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        begin.record()
        replay()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) * 1e3 / calls)
    return sorted(samples)[len(samples) // 2]


def kernel_breakdown(fn, label: str, lines: list[str], top: int = 8) -> dict[str, float]:
    """One call of fn profiled: its kernel time by kind, the longest kernels and the gaps, appended to lines.
    Returns the milliseconds of kernel time by kind (``KINDS``)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    rows = []
    for event in prof.key_averages():
        if event.device_type.name != "CUDA" or event.self_device_time_total <= 0:
            continue
        kind = kind_of(event.key)
        by_kind[kind][0] += event.self_device_time_total / 1e3
        by_kind[kind][1] += event.count
        rows.append((event.self_device_time_total / 1e3, event.count, event.key))
    total = sum(v[0] for v in by_kind.values())
    launches = sum(v[1] for v in by_kind.values())
    lines.append(f"-- {label}: {total:.2f} ms of kernel time in {launches} kernels")
    for kind, (ms, count) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"   {kind:<18} {ms:7.2f} ms  {count:5d} kernels")
    for ms, count, name in sorted(rows, reverse=True)[:top]:
        lines.append(f"   {ms:7.3f} ms {count:5d}x  {name[:90]}")
    gap_lines(prof, lines, top)
    return {kind: ms for kind, (ms, _) in by_kind.items()}


def gap_lines(prof, lines: list[str], top: int) -> None:
    """The idle time between the profiled kernels, in the order the GPU ran them: the span from the
    first kernel's start to the last one's end, the sum of the gaps between consecutive kernels, and
    the kernel pairs (before -> after) with the most gap in all."""
    kernels = sorted(((event.time_range.start, event.time_range.end, event.key) for event in prof.events()
                      if event.device_type.name == "CUDA" and event.time_range.end > event.time_range.start))
    if len(kernels) < 2:
        return
    by_pair: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for (_, end, before), (start, _, after) in zip(kernels, kernels[1:]):
        pair = by_pair[(before[:40], after[:40])]
        pair[0] += max(0.0, start - end) / 1e3
        pair[1] += 1
    idle = sum(ms for ms, _ in by_pair.values())
    span = (kernels[-1][1] - kernels[0][0]) / 1e3
    lines.append(f"   span {span:.2f} ms, {idle:.2f} ms of it between kernels ({len(kernels)} kernels); "
                 f"the pairs with the most:")
    for (before, after), (ms, count) in sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"   {ms:7.3f} ms {count:5d}x {1e3 * ms / count:5.1f} us  {before} -> {after}")
    lines.append("   the longest gaps, by their place in the sequence:")
    gaps = [(start - end, i) for i, ((_, end, _), (start, _, _)) in enumerate(zip(kernels, kernels[1:]), 1)]
    for gap, i in sorted(gaps, reverse=True)[: max(1, top // 2)]:
        lines.append(f"   {gap:7.1f} us before kernel {i} of {len(kernels)}: {kernels[i - 1][2][:60]} -> "
                     f"{kernels[i][2][:60]}")


def matmul_table(config, lines: list[str], layers: int) -> None:
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", hidden // config.num_attention_heads)
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {
        "q_proj": (q_out, hidden), "k_proj": (kv_out, hidden), "o_proj": (hidden, q_out),
        "qkv fused": (q_out + 2 * kv_out, hidden), "gate_proj": (inter, hidden),
        "gate_up fused": (2 * inter, hidden), "down_proj": (hidden, inter),
        "lm_head (x1)": (config.vocab_size, hidden),
    }
    lines.append(f"{'matmul (per forward)':<22} {'q=1 ms':>8} {'GB/s':>6} {'q=16 ms':>8} {'GB/s':>6} "
                 f"{'q=64 ms':>8} {'GB/s':>6}")
    for name, (out_features, in_features) in shapes.items():
        count = 1 if name.startswith("lm_head") else layers
        weights = [torch.randn(out_features, in_features, dtype=torch.bfloat16, device="cuda") for _ in range(count)]
        nbytes = count * out_features * in_features * 2
        row = f"{name:<22}"
        for q in (1, 16, 64):
            x = torch.randn(q, in_features, dtype=torch.bfloat16, device="cuda")
            replay = graphed(lambda x=x, weights=weights: [F.linear(x, w) for w in weights])
            ms = median_ms(replay)
            row += f" {ms:>8.3f} {nbytes / ms / 1e6:>6.0f}"
        lines.append(row)
        del weights


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--no-matmuls", action="store_true", help="skip the matrix-product table")
    args = parser.parse_args()
    lines: list[str] = []

    source = torch.empty(2**31, dtype=torch.int16, device="cuda")
    bandwidth = 2 * source.numel() * 2 / (median_ms(lambda s=source, d=torch.empty_like(source): d.copy_(s), 10) / 1e3)
    del source
    model = build_random_target(args.shape, torch.bfloat16, torch.device("cuda"))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed_bytes = model.get_input_embeddings().weight.numel() * 2
    floor_ms = (weight_bytes - embed_bytes) / bandwidth * 1e3
    lines.append(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; weights read per forward "
                 f"{(weight_bytes - embed_bytes) / 1e9:.2f} GB"
                 f" (embedding table excluded) -> floor {floor_ms:.2f} ms")
    if not args.no_matmuls:
        matmul_table(model.config, lines, model.config.num_hidden_layers)

    drafter = build_random_drafter(args.shape, model)
    prompt = torch.randint(1, model.config.vocab_size - 1, (1, args.context), device="cuda")
    taps = drafter.spec.target_layer_ids
    runners = [("graph", StaticTarget(model, taps, graphs=True))]
    if args.compile:
        runners.append(("compiled+graph", StaticTarget(model, taps, graphs=True, compile_layers=True)))
    for label, target in runners:
        for q in (1, 64):
            begin = time.perf_counter()
            target.start(capacity=args.context + 600, max_verify=64)
            target.prefill(prompt)
            call = lambda t=target, q=q: t.verify_chain(prompt[0, :q])  # noqa: E731
            call()
            setup = time.perf_counter() - begin
            ms = median_ms(call)
            lines.append(f"{label} verify q={q}: {ms:.2f} ms ({ms / floor_ms:.2f}x floor; setup {setup:.0f} s)")
            kernel_breakdown(call, f"{label} q={q}", lines)

    target = runners[0][1]
    target.start(capacity=args.context + 600, max_verify=64)
    opening = target.prefill(prompt)
    bonus = prompt[0, -1:].clone()
    eager = EagerDrafting(drafter, target, args.context + 600)
    eager.draft(bonus, opening.taps, 15)
    eager_ms = median_ms(lambda: (eager.draft(bonus, opening.taps[:, -4:], 15),
                                  setattr(eager.cache, "length", eager.cache.length - 4)))
    graphs = open_drafting(drafter, target, args.context + 600)
    graphs.draft(bonus, opening.taps, 15)
    graph_ms = median_ms(lambda: (graphs.draft(bonus, opening.taps[:, -4:], 15),
                                  setattr(graphs.cache, "length", graphs.cache.length - 4)))
    lines.append(f"drafter pass (4 new context tokens, 15 rows): eager {eager_ms:.2f} ms, graph {graph_ms:.2f} ms")
    kernel_breakdown(lambda: (graphs.draft(bonus, opening.taps[:, -4:], 15),
                              setattr(graphs.cache, "length", graphs.cache.length - 4)), "drafter graph", lines)
    draft_logits = torch.randn(15, model.config.vocab_size, device="cuda")
    for budget in (16, 256):
        tree_ms = median_ms(lambda b=budget: graphs.build_tree(draft_logits, TreeParams(b)))
        lines.append(f"tree build B={budget} (graph replay): {tree_ms:.2f} ms")
        kernel_breakdown(lambda b=budget: graphs.build_tree(draft_logits, TreeParams(b)), f"tree build B={budget}",
                         lines)
    # a whole DDTree generation: GPU kernel time per round vs wall time per round (the gap is the
    # GPU waiting on Python and on the round's one host read)
    config = GenerationConfig(max_new_tokens=96)
    for budget in (16, 64, 256):
        params = TreeParams(budget)
        run = lambda p=params: ddtree.generate(target, drafter, prompt, config, p, )  # noqa: E731
        run()
        begin = time.perf_counter()
        out = run()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - begin) * 1e3
        lines.append(f"DDTree B={budget}: {out.num_rounds} rounds, {wall / out.num_rounds:.2f} ms per round wall "
                     f"(prefill included: {wall:.1f} ms in all)")
        kernel_breakdown(run, f"DDTree B={budget} whole generation ({out.num_rounds} rounds)", lines, top=10)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
