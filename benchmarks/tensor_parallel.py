"""Tensor-parallel target against one GPU: AR step, DDTree rounds and the all-reduce time per forward.

    python benchmarks/tensor_parallel.py --shape qwen3.6-27b --ranks 2          # needs 2 GPUs
    python benchmarks/tensor_parallel.py --shape qwen3.6-mini --ranks 2 --device cpu --dtype float32

Random weights of a named shape (``workers.models.shapes``) with its random DFlash-shaped drafter,
one random prompt of ``--context`` tokens. For 1 rank and then ``--ranks`` ranks (local processes,
``tools.local_group``: NCCL with one GPU each, or gloo on the CPU) it prints, per rank count: the
AR decode step and the DDTree round at each budget (ms, median over ``--reps`` generations), and
the time of the collectives one forward makes (two all-reduces of the hidden state per layer, one
gather of the logits), timed alone at q = 1. The last column is the issue's goal: the TP step over
the one-GPU step (goal <= 0.6 at TP = 2). Greedy tokens of every method are checked equal between
the two rank counts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

BUDGETS = "16,64,256,1024"


def measure(tp, args: argparse.Namespace) -> dict:
    """One rank's measurements (every rank runs this in lockstep; rank 0's numbers are printed)."""
    from workers.decoding import ar, ddtree
    from workers.decoding.generation import GenerationConfig
    from workers.decoding.params import TreeParams
    from workers.wire import WorkerConfig
    from workers.worker import Worker

    world_size = 1 if tp is None else tp.world_size
    config = WorkerConfig(target=f"random:{args.shape}", drafter=f"random:{args.shape}", dtype=args.dtype,
                          device=args.device, world_size=world_size)
    worker = Worker(config).load(tp if world_size > 1 else None)
    device = worker.target.device
    vocab = worker.model.get_input_embeddings().weight.shape[0]
    prompt = torch.randint(1, vocab - 1, (1, args.context), generator=torch.Generator().manual_seed(0))
    generation = GenerationConfig(max_new_tokens=args.new_tokens)

    def per_round_ms(engine, drafter, params) -> tuple[float, list[int]]:
        engine(worker.target, drafter, prompt, GenerationConfig(max_new_tokens=8), params)  # warm-up
        runs = [engine(worker.target, drafter, prompt, generation, params) for _ in range(args.reps)]
        return statistics.median(r.decode_s / max(r.num_rounds, 1) * 1e3 for r in runs), runs[0].token_ids

    rows = {}
    with torch.inference_mode():
        rows["ar"] = per_round_ms(ar.generate, None, None)
        for budget in (int(b) for b in args.budgets.split(",")):
            rows[f"ddtree B={budget}"] = per_round_ms(ddtree.generate, worker.drafter, TreeParams(budget))
    collectives_ms = 0.0
    if world_size > 1:  # one forward's collectives at q = 1: 2 all-reduces per layer, one logits gather
        layers = len(worker.target.layers)
        hidden = torch.zeros(1, 1, worker.model.config.get_text_config().hidden_size, dtype=worker.target.dtype,
                             device=device)
        local_logits = torch.zeros(1, worker.model.get_output_embeddings().weight.shape[0], dtype=worker.target.dtype,
                                   device=device)

        def collectives() -> None:
            for _ in range(2 * layers):
                tp.all_reduce_(hidden)
            tp.all_gather_last(local_logits)

        collectives()
        samples = []
        for _ in range(args.reps):
            _sync(device)
            begin = time.perf_counter()
            collectives()
            _sync(device)
            samples.append((time.perf_counter() - begin) * 1e3)
        collectives_ms = statistics.median(samples)
    return {"rows": rows, "collectives_ms": collectives_ms}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(tp, args):
    return measure(tp, args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.6-27b")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--budgets", default=BUDGETS)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    from tools.local_group import run_local_group

    backend = "nccl" if args.device == "cuda" else "gloo"
    results = {}
    for world_size in (1, args.ranks):
        outcomes = run_local_group(world_size, _rank, (args,), backend=backend)
        failed = [o for o in outcomes if not o.ok]
        if failed:
            print(f"tensor_parallel.py: {world_size} rank(s): rank {failed[0].rank} failed: {failed[0].error}")
            return 1
        results[world_size] = outcomes[0].value
    one, many = results[1], results[args.ranks]
    print(f"{args.shape}, {args.dtype} on {args.device}, context {args.context}, {args.new_tokens} new tokens; "
          f"TP={args.ranks} collectives per forward (q=1, timed alone): {many['collectives_ms']:.2f} ms")
    print(f"{'method':>16} {'1 rank ms':>10} {f'TP={args.ranks} ms':>10} {'TP / 1':>7} {'same tokens':>12}")
    for name, (one_ms, one_tokens) in one["rows"].items():
        many_ms, many_tokens = many["rows"][name]
        same = one_tokens == many_tokens
        print(f"{name:>16} {one_ms:>10.2f} {many_ms:>10.2f} {many_ms / one_ms:>7.2f} {str(same):>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
