"""Where a round's time goes on the GPU: torch.profiler tables for the drafter pass and an eager verify.

    python benchmarks/profile_round.py [--shape qwen3-8b] [--q 1]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from workers.decoding.drafting import EagerDrafting
from workers.models.runner.target import StaticTarget
from workers.models.shapes import build_random_drafter, build_random_target


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--q", type=int, default=1)
    args = parser.parse_args()
    model = build_random_target(args.shape, torch.bfloat16, torch.device("cuda"))
    drafter = build_random_drafter(args.shape, model)
    target = StaticTarget(model, drafter.spec.target_layer_ids, graphs=False)
    prompt = torch.randint(1, 30000, (1, 1024), device="cuda")
    target.start(capacity=2048, max_verify=64)
    opening = target.prefill(prompt)
    drafting = EagerDrafting(drafter, target, 2048)
    drafting.draft(prompt[0, -1:], opening.taps, 15)  # context in the cache
    print("drafter param devices/dtypes:", {(str(p.device), str(p.dtype)) for p in drafter.parameters()})
    for name, call in (("drafter pass", lambda: drafting.draft(prompt[0, -1:], opening.taps[:, -1:], 15)),
                       (f"eager verify q={args.q}", lambda: target.verify_chain(prompt[0, : args.q]))):
        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
        print(f"== {name}: {kernels} CUDA kernel launches")
        print(events.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
        print(events.table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
