"""``benchmarks/round_gaps.py``: its host timer on a real engine run (CPU, a random mini target and drafter),
the commit stage's time split at the round's one read; and its reading of a trace (a synthetic one)."""

from __future__ import annotations

import time

import torch

from tests.helpers.benchmarks import load_benchmark

WAIT = 0.02  # seconds each read sleeps before reading


@torch.inference_mode()
def test_the_host_timer_splits_each_commit_at_its_read(monkeypatch):
    """Inside ``reads_timed()`` each round's read wait and the host's time after it are summed apart, both
    inside the commit stage; the read is untimed again after. Each read here first sleeps WAIT, as a host
    waits for a GPU: the wait holds it, the time after the read does not."""
    from workers.decoding import generation
    from workers.decoding.generation import GenerationConfig
    from workers.decoding.methods import entry
    from workers.models.runner.target import StaticTarget
    from workers.models.shapes import build_random_drafter, build_random_target

    tool = load_benchmark("round_gaps")
    torch.manual_seed(0)
    model = build_random_target("qwen3-mini", torch.float32, torch.device("cpu"))
    drafter = build_random_drafter("qwen3-mini", model)
    target = StaticTarget(model, drafter.spec.target_layer_ids)
    method = entry("ddtree")
    untimed = generation.ReadLater.__call__

    def waiting(read):
        time.sleep(WAIT)
        return untimed(read)

    monkeypatch.setattr(generation.ReadLater, "__call__", waiting)
    host = tool.HostTimer()
    with host.reads_timed():
        out = method.generate(target, drafter, torch.randint(1, 4000, (1, 12)), GenerationConfig(max_new_tokens=24),
                              method.params_from({"tree_budget": 8}), timer=host)
    assert generation.ReadLater.__call__ is waiting
    totals, rounds = host.totals, out.num_rounds
    assert rounds >= 2 and rounds * WAIT <= totals["read wait"] < 3 * rounds * WAIT  # (a sleep ends late, not early)
    assert 0 < totals["commit after the read"] < rounds * WAIT / 2
    assert totals["read wait"] + totals["commit after the read"] <= totals["commit"]
    assert totals["opening draft"] > 0 and totals["draft"] > 0  # the first draft apart from the rounds'


def test_gaps_are_time_no_kernel_ran_on_any_stream():
    """A chrome trace with a prompt kernel, the engines' opening draft, then a round: two draft kernels on the
    main stream, a commit kernel beside the first (a side stream, starting later and ending sooner), a verify
    kernel after a 50 us wait launched long before it (the device's wait), and a tree kernel whose launch
    began 20 us after the GPU went idle (the host late). The commit's overlap is neither busy time twice nor a
    gap before the second draft kernel; each stage keeps its own kernels' time, and the opening draft is
    not the round's."""
    tool = load_benchmark("round_gaps")
    events = [{"cat": "user_annotation", "name": f"stage:{name}", "ts": begin, "dur": dur}
              for name, begin, dur in (("draft", 10, 5), ("draft", 20, 10), ("commit", 31, 9), ("verify", 60, 1),
                                       ("tree", 410, 20))]
    for correlation, (name, launched, begin, dur) in enumerate((
            ("prompt", -5, 0, 10), ("opening", 11, 95, 4), ("draft 1", 21, 100, 100), ("commit", 35, 120, 20),
            ("draft 2", 22, 200, 50), ("verify", 60.5, 300, 100), ("tree", 420, 430, 10))):
        events.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launched, "dur": 1,
                       "args": {"correlation": correlation}})
        events.append({"cat": "kernel", "name": name, "ts": begin, "dur": dur, "args": {"correlation": correlation}})
    gaps = tool.gaps_by_stage({"traceEvents": events})
    assert (gaps.busy, gaps.span) == (264, 345)
    assert gaps.gaps == {"verify": [50], "tree": [30]}
    assert gaps.before == {("verify", "verify"): [50], ("tree", "tree"): [30]}
    assert gaps.late == {"verify": 0, "tree": 20}
    assert gaps.work == {"opening draft": 4, "draft": 150, "commit": 20, "verify": 100, "tree": 10}
    assert gaps.per_opening == {"opening draft": [0], "draft": [0], "commit": [0], "verify": [50], "tree": [30]}
