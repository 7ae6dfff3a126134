"""What a generation's first draft costs in its decode time, in the three forms it has had: one eager
pass over the prompt's taps ("eager pass"), the prompt's context but its last block written ahead
eagerly then the round's replayed pass ("eager write", c853d92), and that write replayed from a graph
a chunk of rows at a time ("graph write": ``GraphDrafting.write_ahead``, the engines' form). Beside
them, the graph write with the whole q/k/v product ("all heads", the form before the K/V rows alone)
and at other chunk sizes (``--chunks``). CUDA only; random weights of the named shapes.

For each shape and prompt length it prints:
- the first draft alone, each form, and a round's draft beside it (ms, median (min-max) of 15);
- whole generations (16 and 64 new tokens) interleaved, ``--reps`` each: AR beside DFlash and DDTree
  (B = 64), each speculative one with the prompt's write eager and by the graph: decode ms, median
  (min-max), and whether each one's tokens equal AR's (in bfloat16 a wide verify need not give AR's
  bits, so that is information, not a check).

    python benchmarks/first_draft.py --shapes qwen3-8b,qwen3.6-27b
    python benchmarks/first_draft.py --chunks 64 --no-generations   # a smaller write-ahead graph beside
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from workers.decoding import ar, ddtree, dflash
from workers.decoding import drafting as D
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import DFlashParams, TreeParams
from workers.models import drafter as drafter_module
from workers.models.fused_drafter import rms_norm, write_heads
from workers.models.fused_layer import PassInputs
from workers.models.runner.target import StaticTarget
from workers.models.shapes import build_random_drafter, build_random_target

ENGINES_DRAFT, ENGINES_WRITE = D.GraphDrafting.draft, D.GraphDrafting.write_ahead


def one_eager_pass(self, bonus, new_context, rows):
    """``GraphDrafting.draft`` with a prompt's whole context through one eager pass."""
    if new_context.shape[1] > self.drafter.block_size:
        return D._eager_pass(self.drafter, self.target, self.cache, bonus, new_context, rows)
    return ENGINES_DRAFT(self, bonus, new_context, rows)


def eager_write(self, leading_context):
    """``GraphDrafting.write_ahead`` launched op by op."""
    self.drafter.write_context(leading_context, self.cache)


def all_heads_write(drafter, layers, new_context, cache, slots) -> None:
    """``fused_drafter.fused_write_context`` as it was before it multiplied by the K and V rows alone: the
    whole q/k/v product per layer, the queries normed, rotated and folded, then dropped."""
    context = rms_norm(F.linear(new_context[0], drafter.fc.weight), drafter.hidden_norm)
    cos, sin = drafter.rotary_emb(context, slots[None])
    inputs = PassInputs.build(cos, sin, slots, None, 1)
    for layer, kv in zip(layers, cache.pairs, strict=True):
        heads = F.linear(context, layer.qkv_weight, layer.qkv_bias)
        heads = heads.view(context.shape[0], layer.query_heads + 2 * layer.kv_heads, layer.head_dim)
        write_heads(layer, heads, inputs, kv, layer.query_heads)


@contextlib.contextmanager
def all_heads_written() -> Iterator[None]:
    engines = drafter_module.fused_write_context
    drafter_module.fused_write_context = all_heads_write
    try:
        yield
    finally:
        drafter_module.fused_write_context = engines


# each form: (GraphDrafting.draft, GraphDrafting.write_ahead) as it runs them
FORMS = {"eager pass": (one_eager_pass, ENGINES_WRITE), "eager write": (ENGINES_DRAFT, eager_write),
         "graph write": (ENGINES_DRAFT, ENGINES_WRITE)}


@contextlib.contextmanager
def first_draft_form(form: str) -> Iterator[None]:
    D.GraphDrafting.draft, D.GraphDrafting.write_ahead = FORMS[form]
    try:
        yield
    finally:
        D.GraphDrafting.draft, D.GraphDrafting.write_ahead = ENGINES_DRAFT, ENGINES_WRITE


def timings_ms(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - begin) * 1e3)
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} ({min(values):.2f}-{max(values):.2f})"


def first_drafts(drafter, target, context: int, vocab: int, chunks: list[int]) -> str:
    taps = torch.randn(1, context, drafter.fc.in_features, device="cuda", dtype=torch.bfloat16)
    bonus = torch.randint(1, vocab, (1,), device="cuda")
    graphs = D.GraphDrafting(drafter, target, context + 600)
    graphs.draft(bonus, taps, 15)  # captures the round's pass and the write graph
    # the graph write at other chunk sizes, and with the whole q/k/v product: a drafting object each,
    # its write graph captured in its first draft
    variants = {f"graph write, chunk {chunk}": D.GraphDrafting(drafter, target, context + 600, chunk=chunk)
                for chunk in chunks}
    for drafting in variants.values():
        drafting.draft(bonus, taps, 15)
    variants["graph write, all heads"] = D.GraphDrafting(drafter, target, context + 600)
    with all_heads_written():
        variants["graph write, all heads"].draft(bonus, taps, 15)

    def first_draft(form: str, drafting: D.GraphDrafting = graphs) -> None:
        with first_draft_form(form):
            drafting.cache.reset()
            drafting.draft(bonus, taps, 15)

    def round_draft():
        graphs.cache.length = context
        return graphs.draft(bonus, taps[:, -3:], 15)

    times: dict[str, list[float]] = {form: [] for form in FORMS}
    times["a round's draft"] = []
    for _ in range(3):  # interleaved
        for form in FORMS:
            times[form] += timings_ms(lambda f=form: first_draft(f), 5)
        for label, drafting in variants.items():
            times.setdefault(label, [])
            times[label] += timings_ms(lambda d=drafting: first_draft("graph write", d), 5)
        times["a round's draft"] += timings_ms(round_draft, 5)
    return "first draft ms: " + " | ".join(f"{label} {spread(v)}" for label, v in times.items())


def generations(drafter, target, prompt: torch.Tensor, new_tokens: int, reps: int) -> list[str]:
    config = GenerationConfig(max_new_tokens=new_tokens)

    def dflash_run():
        return dflash.generate(target, drafter, prompt, config, DFlashParams())

    def ddtree_run():
        return ddtree.generate(target, drafter, prompt, config, TreeParams(64))

    # label: (the generation, the form of its first draft)
    ways = {"ar": (lambda: ar.generate(target, None, prompt, config), "graph write"),
            "dflash eager write": (dflash_run, "eager write"), "dflash graph write": (dflash_run, "graph write"),
            "ddtree64 eager write": (ddtree_run, "eager write"), "ddtree64 graph write": (ddtree_run, "graph write")}
    runs: dict[str, list[float]] = {label: [] for label in ways}
    tokens: dict[str, list[int]] = {}

    def run(label: str) -> None:
        generate, form = ways[label]
        with first_draft_form(form):
            out = generate()
        runs[label].append(out.decode_s * 1e3)
        tokens.setdefault(label, out.token_ids)

    for label in runs:  # warm: graphs captured, kernels compiled
        run(label)
        runs[label].clear()
    for _ in range(reps):
        for label in runs:
            run(label)
    same = {label: tokens[label] == tokens["ar"] for label in tokens}
    return [f"new {new_tokens} decode ms: " + " | ".join(f"{label} {spread(v)}" for label, v in runs.items()),
            f"  tokens equal AR's (bfloat16): {same}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-8b,qwen3.6-27b")
    parser.add_argument("--contexts", default="64,1024", help="prompt lengths, comma-separated")
    parser.add_argument("--new-tokens", default="16,64")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chunks", default="", help="other write-ahead chunk sizes to time the graph write "
                        f"at, beside the engines' {D.CONTEXT_CHUNK} (comma-separated)")
    parser.add_argument("--no-generations", action="store_true", help="the first draft alone")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for shape in args.shapes.split(","):
        model = build_random_target(shape, torch.bfloat16, torch.device("cuda"))
        drafter = build_random_drafter(shape, model)
        target = StaticTarget(model, drafter.spec.target_layer_ids, graphs=True)
        vocab = model.config.vocab_size - 1
        for context in (int(c) for c in args.contexts.split(",")):
            with torch.inference_mode():
                chunks = [int(c) for c in args.chunks.split(",") if c]
                print(f"{shape} context {context}: {first_drafts(drafter, target, context, vocab, chunks)}",
                      flush=True)
                if args.no_generations:
                    continue
                prompt = torch.randint(1, vocab, (1, context), device="cuda")
                for new_tokens in (int(n) for n in args.new_tokens.split(",")):
                    for line in generations(drafter, target, prompt, new_tokens, args.reps):
                        print(f"{shape} context {context} {line}", flush=True)
        del model, drafter, target
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
