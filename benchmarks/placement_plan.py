"""What a worker's GPUs would hold, as the placement plan computes it before loading (no GPU, no weights).

    python benchmarks/placement_plan.py [--shape qwen3.6-27b] [--gpus 2] [--gpu-gb 48]

Prints the layer split (``parallel: layers``: ``workers.models.placement.plan_split``) and the
tensor-parallel shard (``parallel: tensor``: ``plan_tensor_parallel``) of a ``random:`` shape's config
over ``--gpus`` GPUs of ``--gpu-gb`` GB, for the run budget a sweep reserves (``RunBudget``: context,
widest verify pass, kept CUDA graphs), with the shape's DFlash drafter. A plan that does not fit
prints the refusal a sweep would give. Computed, not measured: it is what the worker reserves.
"""

from __future__ import annotations

import argparse

import torch

from workers.errors import BadInputError
from workers.models.drafter_config import DrafterSpec
from workers.models.placement import RunBudget, drafter_bytes_for, plan_split, plan_tensor_parallel
from workers.models.shapes import drafter_config, target_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3.6-27b", help="a workers.models.shapes name")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--gpu-gb", type=float, default=48.0, help="each GPU's memory in GB (10^9 bytes)")
    args = parser.parse_args()

    config = target_config(args.shape)
    drafter = drafter_bytes_for(DrafterSpec.from_dict(drafter_config(args.shape)), torch.bfloat16)
    size, budget = int(args.gpu_gb * 10**9), RunBudget()
    print(f"{args.shape} in bf16 over {args.gpus} x {args.gpu_gb:g} GB; run budget: {budget.max_tokens} tokens, "
          f"verify passes up to {budget.max_verify} nodes, {budget.graph_widths} verify graphs kept; "
          f"drafter {drafter / 2**30:.2f} GiB")
    print("\nparallel: layers (one actor holds every GPU)")
    try:
        print(plan_split(config, [size] * args.gpus, torch.bfloat16, drafter_bytes=drafter, budget=budget).describe())
    except BadInputError as exc:
        print(f"refused: {exc}")
    print(f"\nparallel: tensor ({args.gpus} ranks, one GPU each)")
    try:
        print(plan_tensor_parallel(config, size, args.gpus, torch.bfloat16, drafter, budget).describe())
    except BadInputError as exc:
        print(f"refused: {exc}")


if __name__ == "__main__":
    main()
