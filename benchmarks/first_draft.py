"""What a generation's first draft costs in its decode time, as one eager pass over the prompt's taps
and as the engines run it now (``GraphDrafting.draft``: the prompt's context but its last block
written ahead eagerly, then the round's replayed pass). CUDA only; random weights of the named shapes.

For each shape and prompt length it prints:
- the first draft alone, both ways, and a round's draft beside it (ms, median (min-max) of 15);
- whole generations (16 and 64 new tokens) interleaved, ``--reps`` each: AR beside DFlash and DDTree
  (B = 64), each speculative one with the first draft as one eager pass ("eager first") and as the
  engines run it ("now"): decode ms, median (min-max), and whether each one's tokens equal AR's (in
  bfloat16 a wide verify need not give AR's bits, so that is information, not a check).

    python benchmarks/first_draft.py --shapes qwen3-8b,qwen3.6-27b
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from workers.decoding import ar, ddtree, dflash
from workers.decoding import drafting as D
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import DFlashParams, TreeParams
from workers.models.runner.target import StaticTarget
from workers.models.shapes import build_random_drafter, build_random_target

ENGINES_DRAFT = D.GraphDrafting.draft


def eager_first_draft(self, bonus, new_context, rows):
    """``GraphDrafting.draft`` with a prompt's whole context through one eager pass (the baseline)."""
    if new_context.shape[1] > self.drafter.block_size:
        return D._eager_pass(self.drafter, self.target, self.cache, bonus, new_context, rows)
    return ENGINES_DRAFT(self, bonus, new_context, rows)


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


def first_drafts(drafter, target, context: int, vocab: int) -> str:
    taps = torch.randn(1, context, drafter.fc.in_features, device="cuda", dtype=torch.bfloat16)
    bonus = torch.randint(1, vocab, (1,), device="cuda")
    eager = D.EagerDrafting(drafter, target, context + 600)
    graphs = D.GraphDrafting(drafter, target, context + 600)
    graphs.draft(bonus, taps, 15)  # captures the round's pass

    def eager_first():
        eager.cache.reset()
        return eager.draft(bonus, taps, 15)

    def engines_first():
        graphs.cache.reset()
        return graphs.draft(bonus, taps, 15)

    def round_draft():
        graphs.cache.length = context
        return graphs.draft(bonus, taps[:, -3:], 15)

    eager_ms, engines_ms, round_ms = [], [], []
    for _ in range(3):  # interleaved
        eager_ms += timings_ms(eager_first, 5)
        engines_ms += timings_ms(engines_first, 5)
        round_ms += timings_ms(round_draft, 5)
    return (f"first draft: one eager pass {spread(eager_ms)} ms | written ahead + replayed {spread(engines_ms)} ms"
            f" | a round's draft {spread(round_ms)} ms")


def generations(drafter, target, prompt: torch.Tensor, new_tokens: int, reps: int) -> list[str]:
    config = GenerationConfig(max_new_tokens=new_tokens)

    def dflash_run():
        return dflash.generate(target, drafter, prompt, config, DFlashParams())

    def ddtree_run():
        return ddtree.generate(target, drafter, prompt, config, TreeParams(64))

    # label: (the generation, whether its first draft is one eager pass)
    ways = {"ar": (lambda: ar.generate(target, None, prompt, config), False),
            "dflash eager first": (dflash_run, True), "dflash now": (dflash_run, False),
            "ddtree64 eager first": (ddtree_run, True), "ddtree64 now": (ddtree_run, False)}
    runs: dict[str, list[float]] = {label: [] for label in ways}
    tokens: dict[str, list[int]] = {}

    def run(label: str) -> None:
        generate, eager_first = ways[label]
        D.GraphDrafting.draft = eager_first_draft if eager_first else ENGINES_DRAFT
        try:
            out = generate()
        finally:
            D.GraphDrafting.draft = ENGINES_DRAFT
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
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for shape in args.shapes.split(","):
        model = build_random_target(shape, torch.bfloat16, torch.device("cuda"))
        drafter = build_random_drafter(shape, model)
        target = StaticTarget(model, drafter.spec.target_layer_ids, graphs=True)
        vocab = model.config.vocab_size - 1
        for context in (int(c) for c in args.contexts.split(",")):
            with torch.inference_mode():
                print(f"{shape} context {context}: {first_drafts(drafter, target, context, vocab)}", flush=True)
                prompt = torch.randint(1, vocab, (1, context), device="cuda")
                for new_tokens in (int(n) for n in args.new_tokens.split(",")):
                    for line in generations(drafter, target, prompt, new_tokens, args.reps):
                        print(f"{shape} context {context} {line}", flush=True)
        del model, drafter, target
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
