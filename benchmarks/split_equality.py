"""Which of eager / whole-graph / two-segment-graph runs of one target differ, in bf16 on a GPU.

    python benchmarks/split_equality.py [--shape qwen3.6-27b] [--context 1024] [--new-tokens 32]

Prints, for the prompt's last logits and for greedy AR tokens, the largest difference and the first
differing token of each runner against the eager one (graph == eager is meant to hold bit for bit).
"""

from __future__ import annotations

import argparse

import torch

from workers.decoding import ar
from workers.decoding.generation import GenerationConfig
from workers.models.runner.target import StaticTarget
from workers.models.shapes import build_random_target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.6-27b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_random_target(args.shape, torch.bfloat16, torch.device("cuda"))
    half = (model.config.num_hidden_layers // 2,)
    runners = {"eager": StaticTarget(model, graphs=False), "graph": StaticTarget(model, graphs=True),
               "split": StaticTarget(model, graphs=True, segment_starts=half)}
    prompt = torch.randint(1, model.config.vocab_size - 1, (1, args.context), device="cuda")
    logits, tokens = {}, {}
    with torch.inference_mode():
        for name, runner in runners.items():
            for _ in range(2):  # the second prompt replays what the first captured
                runner.start(capacity=args.context + 600, max_verify=64)
                logits[name] = runner.prefill(prompt).logits.float().clone()
            tokens[name] = ar.generate(runner, None, prompt, GenerationConfig(max_new_tokens=args.new_tokens)).token_ids
    for name in ("graph", "split"):
        diff = (logits[name] - logits["eager"]).abs().max().item()
        first = next((i for i, (a, b) in enumerate(zip(tokens[name], tokens["eager"])) if a != b), None)
        print(f"{name:>6} vs eager: prompt logits max |diff| {diff:.3g}; AR tokens first differ at {first}")
    diff = (logits["split"] - logits["graph"]).abs().max().item()
    first = next((i for i, (a, b) in enumerate(zip(tokens["split"], tokens["graph"])) if a != b), None)
    print(f" split vs graph: prompt logits max |diff| {diff:.3g}; AR tokens first differ at {first}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
