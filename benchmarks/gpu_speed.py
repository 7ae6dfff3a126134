"""Target forwards against the memory-bandwidth floor, with and without CUDA graphs (issue 5's table).

    python benchmarks/gpu_speed.py [--shape qwen3-8b] [--context 1024] [--reps 10] [--qs 1,16,64,128,256,512]

Random weights of a named shape (``workers.models.shapes``) in bf16 on one GPU, with its DFlash-shaped
drafter (5 layers, block 16). Prints, last, one table:
- two floors per pass of q tokens: weight bytes / measured copy bandwidth (a large device-to-device
  copy), and 2 x matmul parameters (all but the input embedding) x q / measured bf16 matmul rate
  (an 8192^3 product on random data); the ratio column is graph time over the larger of the two;
- target verify time per q (chain and tree masks): transformers' own forward on a DynamicCache
  (``AttentionTarget``; attention-only shapes), our loop eagerly, and our loop replaying a CUDA graph
  (``--split``: also in two segments of layers on this GPU, one graph per segment);
- the prompt (``--context`` tokens) through ``prefill`` against the compute floor;
- the drafter's forward (one block), eager and as a graph; a generation's first draft over the prompt's
  taps (the engines run it once, in the decode time), eager and as the engines run it; the tree work per
  round for B = 16..1024 (build on the GPU, unlimited and branching 8; walk; commit);
- full rounds: AR decode step, DFlash round, DDTree rounds, eager vs graphs (``--round-reps`` graph-replayed
  generations each: their median, least and most) (and the split target);
- checks: graph outputs equal eager outputs (greedy tokens, every method);
- last, the floors measured again, then issues 12 and 28's goals against what this run measured (those it
  measured; ``goals.py``), each with its spread over the samples and both floor measurements and, for the
  DDTree rounds, the least ratio this GPU allows (``least_round``; "out of reach" where it exceeds the
  goal) and, for the widths ``--profile`` names, the least with this run's products (every other kernel
  free; "out of reach with these products"), then what ``lt_product`` timed and chose per product shape
  (``--no-lt``: none of it).
``--attention-form shared`` runs the attention kernel's shared form, ``chosen`` the form each pass shape's trial
chose (``attention_triton.SHARED``, key splits by default);
``--commit-branches N`` puts a commit's pieces on N streams (``runner.loop.COMMIT_BRANCHES``) and ``--commit-beside
on|off`` each round's commit beside the next draft or after it (``decoding.generation.COMMIT_BESIDE_DRAFT``),
``--commit-form replay|chunk`` each GDN layer's commit token by token or regrouped (``gdn_triton.COMMIT_FORM``),
``--tree-forms 32/3/1,64/2/1,...`` the GDN tree kernel's forms each tree-pass shape tries (``gdn_triton.FORM_CHOICES``);
by default each as its module sets it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from goals import Spread, goal_lines  # a sibling script: benchmarks/ is on sys.path

from tests.helpers.reference import AttentionTarget
from workers.decoding import ar, ddtree, dflash, generation
from workers.decoding.drafting import EagerDrafting, GraphDrafting, open_drafting
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import DFlashParams, TreeParams
from workers.decoding.tree import build_tree, follow_tree
from workers.models import attention_triton, gdn_triton, lt_product, pdl_triton
from workers.models.kernels import dependent_launches
from workers.models.runner import loop
from workers.models.runner.target import StaticTarget
from workers.models.shapes import build_random_drafter, build_random_target
from workers.seam import is_hybrid

QS = "1,16,64,128,256,512"
BUDGETS = "16,64,256,1024"


def samples_ms(fn, reps: int = 20) -> list[float]:
    """fn's wall time, synchronised, ``reps`` times after one warm-up call (ms)."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        begin = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - begin) * 1e3)
    return samples


def median_ms(fn, reps: int = 20) -> float:
    return statistics.median(samples_ms(fn, reps))


def copy_bandwidth() -> float:
    """Bytes per second moved by a 4 GiB device-to-device copy (read + write counted)."""
    source = torch.empty(2**31, dtype=torch.int16, device="cuda")
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), 10)
    return 2 * source.numel() * 2 / (ms / 1e3)


def matmul_rate() -> float:
    """bf16 FLOP per second of an 8192^3 matrix product on random data."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = median_ms(lambda: a @ b, 10)
    return 2 * 8192**3 / (ms / 1e3)


def model_sizes(model) -> tuple[int, int]:
    """(bytes of every weight: a forward's read, parameters in products: all but the input embedding)."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return weight_bytes, sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()


def random_tree(vocab: int, nodes: int, depth: int = 15):
    log_probs = torch.log_softmax(torch.randn(depth, vocab, device="cuda") * 4, dim=-1)
    return build_tree(log_probs, TreeParams(nodes - 1, max_depth=depth))


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--lt-timing", choices=("eager", "graph"),
                        help="how lt_product times its candidates (lt_product.TIMING; default: as the module sets it)")
    parser.add_argument("--round-reps", type=int, default=3,
                        help="graph-replayed generations per method, for the rounds' spread in the goals")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd layers under graphs")
    parser.add_argument("--only-forwards", action="store_true", help="stop after the verify table")
    parser.add_argument("--qs", default=QS, help="verify widths, comma-separated")
    parser.add_argument("--split", action="store_true",
                        help="also time the target in two segments of layers on this GPU (one graph per segment)")
    parser.add_argument("--profile", default="",
                        help="tree widths whose graph pass is profiled by kernel, comma-separated")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per profile, by time")
    parser.add_argument("--budgets", default=BUDGETS, help="DDTree budgets of the tree work and rounds")
    parser.add_argument("--wide-triton", action="store_true",
                        help="the layers' 256-272-row products by workers.models.wide_triton (off on every GPU: "
                             "benchmarks/wide_gemm.py), to time a pass with it")
    parser.add_argument("--no-lt", action="store_true",
                        help="torch's own products where workers.models.lt_product would time cuBLASLt's algorithms")
    parser.add_argument("--attention-form", choices=sorted(attention_triton.FORMS),
                        help="the attention's work in key splits, shared among one round of programs, or chosen "
                             "per pass shape on trial (attention_triton.SHARED; default: as the module sets it)")
    parser.add_argument("--commit-branches", type=int,
                        help="a commit's pieces on this many CUDA streams (runner.loop.COMMIT_BRANCHES; default: "
                             "as the module sets it)")
    parser.add_argument("--commit-beside", choices=("on", "off"),
                        help="each round's commit beside the next draft or after it "
                             "(decoding.generation.COMMIT_BESIDE_DRAFT; default: as the module sets it)")
    parser.add_argument("--commit-form", choices=("replay", "chunk"),
                        help="each GDN layer's commit token by token or in the regrouped form "
                             "(gdn_triton.COMMIT_FORM; default: as the module sets it)")
    parser.add_argument("--tree-forms",
                        help="the GDN tree kernel's forms each tree-pass shape tries, step/stages/blocks, comma-"
                             "separated, the first the default (gdn_triton.FORM_CHOICES; e.g. 32/3/1,64/2/1,32/3/2 "
                             "to try the paired form too)")
    args = parser.parse_args()
    lt_product.ENABLED = not args.no_lt
    if args.attention_form:
        attention_triton.SHARED = attention_triton.FORMS[args.attention_form]
    if args.commit_branches is not None:
        loop.COMMIT_BRANCHES = args.commit_branches
    if args.commit_beside is not None:
        generation.COMMIT_BESIDE_DRAFT = args.commit_beside == "on"
    if args.lt_timing is not None:
        lt_product.TIMING = args.lt_timing
    if args.commit_form is not None:
        from workers.models import gdn_triton

        gdn_triton.COMMIT_FORM = args.commit_form
    if args.tree_forms:
        from workers.models import gdn_triton

        gdn_triton.FORM_CHOICES = tuple(tuple(int(part) for part in form.split("/"))
                                        for form in args.tree_forms.split(","))
    if args.wide_triton:
        from workers.models import wide_triton

        wide_triton.FASTER_ON = frozenset({torch.cuda.get_device_capability()})
    # each product shape's cuBLASLt choice timed at first sight: here the eager passes come first, where
    # in a worker the graphs' warm-ups meet the same shapes first (``lt_product``)
    with lt_product.choosing():
        return measure(args)


class PrintedLines(list):
    """The report's lines, each printed as it is added: a run cut short (a time limit, a machine taken
    back) still shows what it measured."""

    def append(self, line: str) -> None:
        print(line, flush=True)
        super().append(line)


def measure(args: argparse.Namespace) -> int:
    device = torch.device("cuda")
    lines: list[str] = PrintedLines()
    measured: dict = {"split ratios": []}  # what the goals table reads
    budgets = tuple(int(b) for b in args.budgets.split(","))

    qs = tuple(int(q) for q in args.qs.split(","))
    bandwidth, rate = copy_bandwidth(), matmul_rate()
    model = build_random_target(args.shape, torch.bfloat16, device)
    drafter = build_random_drafter(args.shape, model)
    vocab = model.config.vocab_size
    hybrid = is_hybrid(model.config)
    measured["hybrid"], measured["context"] = hybrid, args.context
    weight_bytes, matmul_params = model_sizes(model)
    floor_ms = weight_bytes / bandwidth * 1e3
    measured["floor W"] = floor_ms
    measured["floor C per row"] = 2 * matmul_params / rate * 1e3
    floors = [(bandwidth, rate)]  # measured again at the end: the goals' spread takes both

    def compute_floor_ms(q: int) -> float:
        return measured["floor C per row"] * q

    with dependent_launches():
        ar_pdl = pdl_triton.launch_options(device)
    lines.append(f"{args.shape}: {weight_bytes / 1e9:.1f} GB bf16 weights, {matmul_params / 1e9:.1f}e9 matmul params; "
                 f"copy bandwidth {bandwidth / 1e12:.2f} TB/s -> weight floor {floor_ms:.2f} ms per forward; "
                 f"bf16 matmul {rate / 1e12:.0f} TFLOP/s in a burst (held for seconds, the power limit lowers it: "
                 f"benchmarks/sustained.py) -> compute floor {compute_floor_ms(1):.3f} ms x q; "
                 f"context {args.context}; AR's step with PDL: {bool(ar_pdl['PDL'])} "
                 f"({pdl_triton.SWITCH}=0 turns it off)")
    prompt = torch.randint(1, vocab - 1, (1, args.context), device=device)
    taps = drafter.spec.target_layer_ids

    # --- target verify time per q ------------------------------------------------------------------
    eager = StaticTarget(model, taps, graphs=False)
    graphed = StaticTarget(model, taps, graphs=True)
    plain = None if hybrid else AttentionTarget(model, taps)  # transformers' cache cannot fork GDN state
    half = (model.config.num_hidden_layers // 2,)
    split = StaticTarget(model, taps, graphs=True, segment_starts=half) if args.split else None
    compiled = None
    if args.compile:
        import torch._dynamo as dynamo

        dynamo.config.cache_size_limit = 64
        compiled = StaticTarget(model, taps, graphs=True, compile_layers=True)
    lines.append(f"{'q':>5} {'mask':>5} {'plain ms':>9} {'eager ms':>9} {'graph ms':>9} {'floor W':>8} "
                 f"{'floor C':>8} {'graph/floor':>11} {'split ms':>9} {'compiled+graph ms':>18}")
    for q in qs:
        tree = random_tree(vocab, q).to(device) if q > 1 else None
        for mask in ("chain", "tree") if q > 1 else ("chain",):
            row = []
            for runner in (plain, eager, graphed, split):
                if runner is None:
                    row.append(float("nan"))
                    continue
                runner.start(capacity=args.context + 600, max_verify=max(qs))
                runner.prefill(prompt)
                if mask == "chain":
                    tokens = prompt[0, :q]
                    call = lambda r=runner, t=tokens: r.verify_chain(t)  # noqa: E731
                else:
                    call = lambda r=runner, t=tree: r.verify_tree(prompt[0, 0], t)  # noqa: E731
                if runner is plain:  # its DynamicCache grows per pass: commit one token to keep it bounded
                    step = lambda c=call, r=runner: (c(), r.commit(torch.zeros(1, dtype=torch.long)))  # noqa: E731
                    row.append(median_ms(step, min(args.reps, 5)))
                else:
                    samples = samples_ms(call, args.reps)
                    row.append(statistics.median(samples))
                    if runner is graphed:
                        measured[f"verify {q} {mask}"] = Spread.of(samples)
            fused = "-"
            if compiled is not None and mask == "chain" and q in (1, 16, 64, 256):
                begin = time.perf_counter()
                compiled.start(capacity=args.context + 600, max_verify=max(qs))
                compiled.prefill(prompt)
                call = lambda t=prompt[0, :q]: compiled.verify_chain(t)  # noqa: E731
                call()
                setup_s = time.perf_counter() - begin
                fused = f"{median_ms(call, args.reps):.2f} (setup {setup_s:.0f}s)"
            floor = max(floor_ms, compute_floor_ms(q))
            if split is not None:
                measured["split ratios"].append(row[3] / row[2])
            lines.append(f"{q:>5} {mask:>5} {row[0]:>9.2f} {row[1]:>9.2f} {row[2]:>9.2f} {floor_ms:>8.2f} "
                         f"{compute_floor_ms(q):>8.2f} {row[2] / floor:>10.2f}x {row[3]:>9.2f} {fused:>18}")

    for q in (int(q) for q in args.profile.split(",") if q):
        from forward_anatomy import kernel_breakdown  # a sibling script: benchmarks/ is on sys.path

        graphed.start(capacity=args.context + 600, max_verify=max(qs))
        graphed.prefill(prompt)
        tree = random_tree(vocab, q).to(device) if q > 1 else None
        call = ((lambda t=tree: graphed.verify_tree(prompt[0, 0], t)) if tree
                else (lambda: graphed.verify_chain(prompt[0, :1])))
        by_kind = kernel_breakdown(call, f"graph verify q={q}", lines, top=args.top)
        if "matmul" in by_kind:  # the products alone, for the goals' "products" bound
            measured[f"products {q}"] = by_kind["matmul"]

    # --- the prompt --------------------------------------------------------------------------------------
    def prefill_once(runner=graphed):
        runner.start(capacity=args.context + 600, max_verify=max(qs))
        runner.prefill(prompt)

    def prefill_only_ms(runners: dict, reps: int) -> dict:
        """Prefill times per runner (a ``Spread``), each after a fresh ``start`` that the timing leaves out;
        the runners take turns, so a drift of the GPU's clock reaches them all alike."""
        samples = {label: [] for label in runners}
        for rep in range(reps + 1):  # the first: warm-up
            for label, runner in runners.items():
                runner.start(capacity=args.context + 600, max_verify=max(qs))
                torch.cuda.synchronize()
                begin = time.perf_counter()
                runner.prefill(prompt)
                torch.cuda.synchronize()
                if rep:
                    samples[label].append((time.perf_counter() - begin) * 1e3)
        return {label: Spread.of(times) for label, times in samples.items()}

    runners = {label: runner for label, runner in (("eager", eager), ("graph", graphed), ("split graphs", split))
               if runner is not None}
    for label, prefill in prefill_only_ms(runners, max(5, args.reps)).items():
        runner = runners[label]
        measured[f"prefill {label}"] = prefill
        floor = compute_floor_ms(args.context)
        lines.append(f"prefill {args.context} tokens, {label}: {prefill.middle:.1f} ms ({prefill.low:.1f}-"
                     f"{prefill.high:.1f}; chunks of {runner.prefill_chunk}); compute floor {floor:.1f} ms -> "
                     f"{prefill.middle / floor:.2f}x")
    if args.profile:
        from forward_anatomy import kernel_breakdown

        kernel_breakdown(prefill_once, f"prefill {args.context}", lines, top=args.top)

    if split is not None:
        measured["split ratios"].append(measured["prefill split graphs"].middle / measured["prefill graph"].middle)
    if args.only_forwards:
        print("\n".join(remeasured_floors(measured, floors, weight_bytes, matmul_params) + goal_lines(measured)
                        + lt_lines()))
        return 0

    # --- drafter and the host-side tree work ----------------------------------------------------------
    graphed.start(capacity=args.context + 600, max_verify=1025)
    opening = graphed.prefill(prompt)
    eager_drafting = EagerDrafting(drafter, graphed, args.context + 600)
    bonus = prompt[0, -1:].clone()
    context = opening.taps
    draft_ms = median_ms(lambda: eager_drafting.draft(bonus, context[:, -1:], 15), args.reps)

    def first_draft():  # a generation's first draft as one eager pass over the prompt's taps (EagerDrafting's)
        eager_drafting.cache.reset()
        return eager_drafting.draft(bonus, context, 15)

    first_draft_ms = median_ms(first_draft, args.reps)
    graphs = open_drafting(drafter, graphed, args.context + 600)  # kept with the target for the rounds below
    op_by_op = GraphDrafting(drafter, graphed, args.context + 600, fused=False)
    timed = {}
    for label, drafting in (("graph", graphs), ("graph op by op", op_by_op)):
        drafting.draft(bonus, context, 15)  # the prompt's context (its leading rows written ahead by a graph)
        timed[label] = median_ms(lambda d=drafting: d.draft(bonus, context[:, -1:], 15), args.reps)
    # the pass reads the drafter's weights and the target's lm_head once (and 16 embedding rows)
    draft_bytes = sum(p.numel() * p.element_size() for p in drafter.parameters())
    draft_bytes += model.get_output_embeddings().weight.numel() * model.get_output_embeddings().weight.element_size()
    draft_floor = draft_bytes / bandwidth * 1e3
    measured["drafter graph"], measured["drafter floor"] = timed["graph"], draft_floor

    def first_draft_replayed():  # as the engines run it: the leading rows' K/V written ahead, the last block replayed
        graphs.cache.reset()
        return graphs.draft(bonus, context, 15)

    first_replayed_ms = median_ms(first_draft_replayed, args.reps)
    lines.append(f"drafter forward (block {drafter.block_size}) + lm_head on 15 rows: {draft_ms:.2f} ms eager, "
                 f"{timed['graph']:.2f} ms graph (fused layers; {timed['graph'] / draft_floor:.2f}x its weight floor "
                 f"{draft_floor:.2f} ms), {timed['graph op by op']:.2f} ms graph op by op")
    lines.append(f"a generation's first draft (the prompt's {context.shape[1]} rows of taps; in its decode time, "
                 f"once): {first_draft_ms:.2f} ms eager, {first_replayed_ms:.2f} ms with the leading rows written "
                 "ahead by a graph and the round's pass replayed (the engines')")
    if args.profile:
        from forward_anatomy import kernel_breakdown

        for label, drafting in (("fused", graphs), ("op by op", op_by_op)):
            kernel_breakdown(lambda d=drafting: d.draft(bonus, context[:, -1:], 15), f"drafter pass, graph, {label}",
                             lines, top=args.top)
    lines.append(f"{'B':>5} {'build ms':>9} {'K<=8':>6} {'graph ms':>9} {'K<=8':>6} {'walk ms':>8} {'commit ms':>10}"
                 "   (tree built on the GPU: eager, replayed)")
    draft_logits = torch.randn(15, vocab, device=device)
    for budget in budgets:
        build = median_ms(lambda b=budget: build_tree(torch.log_softmax(draft_logits.float(), -1), TreeParams(b)), 5)
        capped = median_ms(lambda b=budget: build_tree(torch.log_softmax(draft_logits.float(), -1),
                                                       TreeParams(b, branching=8)), 5)
        replayed = median_ms(lambda b=budget: graphs.build_tree(draft_logits, TreeParams(b)), 5)
        replayed_capped = median_ms(lambda b=budget: graphs.build_tree(draft_logits, TreeParams(b, branching=8)), 5)
        on_device = build_tree(torch.log_softmax(draft_logits.float(), -1), TreeParams(budget))
        choices = torch.randint(0, vocab, (budget + 1,), device=device)
        walk = median_ms(lambda t=on_device: follow_tree(t.tokens, t.parents, t.visibility, choices)[0].cpu(), 5)
        graphed.start(capacity=args.context + 1100, max_verify=budget + 1)
        graphed.prefill(prompt[:, :128])
        path = follow_tree(on_device.tokens, on_device.parents, on_device.visibility,
                           on_device.tokens.new_zeros(budget + 1))[0].cpu()
        timings = []
        for _ in range(3):  # the first commit of a (width, length) runs eagerly and is captured; later ones replay
            graphed.verify_tree(prompt[0, 0], on_device)
            torch.cuda.synchronize()
            begin = time.perf_counter()
            graphed.commit(path)
            torch.cuda.synchronize()
            timings.append((time.perf_counter() - begin) * 1e3)
        commit = timings[-1]
        lines.append(f"{budget:>5} {build:>9.2f} {capped:>6.2f} {replayed:>9.2f} {replayed_capped:>6.2f} {walk:>8.2f} "
                     f"{commit:>10.2f}")
        if args.profile:
            from forward_anatomy import kernel_breakdown

            kernel_breakdown(lambda b=budget: graphs.build_tree(draft_logits, TreeParams(b)),
                             f"tree build B={budget}, graph", lines, top=args.top)

    # --- whole rounds, and graph == eager -------------------------------------------------------------
    lines.append(f"{'method':>18} {'eager ms/round':>15} {'graph ms/round (spread)':>22} {'split ms/round':>15} "
                 f"{'same tokens':>12}")
    config = GenerationConfig(max_new_tokens=args.new_tokens)
    cases = [("ar", ar.generate, None), ("dflash", dflash.generate, DFlashParams())]
    cases += [(f"ddtree B={b}", ddtree.generate, TreeParams(b)) for b in budgets]
    graph_rounds = {}
    for name, engine, params in cases:
        results = []
        for runner in (eager, graphed, split):
            if runner is None:
                continue
            # warm-up
            engine(runner, drafter if params else None, prompt, GenerationConfig(max_new_tokens=8), params)
            out = engine(runner, drafter if params else None, prompt, config, params)
            results.append(out)
            if runner is graphed:  # the goals' rounds: --round-reps generations, for their spread
                graph_rounds[name] = [out] + [engine(runner, drafter if params else None, prompt, config, params)
                                              for _ in range(args.round_reps - 1)]
        per_round = [o.decode_s / max(o.num_rounds, 1) * 1e3 for o in results]
        same = all(r.token_ids == results[0].token_ids for r in results + graph_rounds[name])
        split_ms = per_round[2] if split is not None else float("nan")
        measured[f"round {name}"] = Spread.of([o.decode_s / max(o.num_rounds, 1) * 1e3 for o in graph_rounds[name]])
        if split is not None:
            measured["split ratios"].append(split_ms / per_round[1])
        lines.append(f"{name:>18} {per_round[0]:>15.2f} {str(measured[f'round {name}']):>22} {split_ms:>15.2f} "
                     f"{str(same):>12}")
    print("\n".join(remeasured_floors(measured, floors, weight_bytes, matmul_params) + goal_lines(measured)
                    + lt_lines()))
    return 0


def remeasured_floors(measured: dict, floors: list, weight_bytes: int, matmul_params: int) -> list[str]:
    """The floors measured again, now the passes and rounds have run (the clock may have moved): both
    measurements go into ``measured`` for the goals' spread; returns a line with them."""
    floors.append((copy_bandwidth(), matmul_rate()))
    bandwidths, rates = zip(*floors, strict=True)
    measured["floor W"] = Spread.first_of([weight_bytes / b * 1e3 for b in bandwidths])
    measured["floor C per row"] = Spread.first_of([2 * matmul_params / r * 1e3 for r in rates])
    return [f"floors at the start / the end: copy {' / '.join(f'{b / 1e12:.2f}' for b in bandwidths)} TB/s, bf16 "
            f"8192^3 product {' / '.join(f'{r / 1e12:.0f}' for r in rates)} TFLOP/s in a burst (the goals' spread "
            f"takes both, and each pass's and round's least and most)"]


def lt_lines() -> list[str]:
    """What ``lt_product`` timed and chose per product shape in this run (nothing with --no-lt), the
    attention's form per pass shape where it was chosen on trial (``--attention-form chosen``), and the GDN
    tree kernel's form (step along dk, pipeline stages, blocks a program) per pass shape (hybrids)."""
    chosen, forms, gdn_forms = lt_product.report(), attention_triton.report(), gdn_triton.forms_report()
    return ((["cuBLASLt per shape (lt_product: torch's call, the fastest offered algorithm, the choice):"] + chosen
             if chosen else [])
            + (["attention form per pass shape (attention_triton: the trial, the choice):"] + forms if forms else [])
            + (["GDN tree kernel's form per pass shape (gdn_triton: the trial, the choice):"] + gdn_forms
               if gdn_forms else []))


if __name__ == "__main__":
    raise SystemExit(main())
