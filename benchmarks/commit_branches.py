"""A target's commit with its pieces on one CUDA stream or several (``runner.loop.COMMIT_BRANCHES``), in
line after the next draft or beside it (``decoding.generation.COMMIT_BESIDE_DRAFT``), each GDN layer's
commit token by token or in the regrouped form (``gdn_triton.COMMIT_FORM``).

    python benchmarks/commit_branches.py [--shape qwen3.6-27b] [--branches 1,2,4,8] [--forms replay,chunk]
                                         [--lengths 1,8,16]

A commit after a verify pass moves the accepted K/V rows and, in every GDN layer, advances the state
over the accepted path from the committed state: one short kernel a layer, latency-bound, the layers
independent of each other. The replay form's time grows with the path (a step a token); the chunk
form's should hardly grow. On one stream the layers run one after another; on several (graph branches
once captured) at once. Random weights of a named shape in bf16 on one GPU, one graphed target per
setting (each captures its own commit graphs), 1024 committed tokens. Prints:
- per path length, the commit's median and quartiles (CUDA events around ``commit``, the
  verify pass before each left out), each setting's turn interleaved with the others', against the
  floor of its bytes (every GDN state read and written once, at this run's copy bandwidth);
- whole rounds of DFlash and DDTree (``--budget``) per setting, the commit in line and beside the next
  draft, interleaved (median and range), whether every setting gave the same tokens, and the tokens a
  round commits (random weights accept little: these rounds commit short paths).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from gpu_speed import copy_bandwidth  # a sibling script: benchmarks/ is on sys.path

from workers.decoding import ddtree, dflash, generation
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import DFlashParams, TreeParams
from workers.decoding.tree import build_tree
from workers.models import gdn_triton
from workers.models.gdn import MAX_PATH
from workers.models.runner import loop
from workers.models.runner.target import StaticTarget
from workers.models.shapes import build_random_drafter, build_random_target


def quartiles(samples: list[float]) -> str:
    low, median, high = statistics.quantiles(samples, n=4)
    return f"{median:8.1f} ({low:.1f}-{high:.1f})"


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.6-27b")
    parser.add_argument("--branches", default="1,2,4,8", help="streams per commit, comma-separated")
    parser.add_argument("--forms", default="replay", help="GDN commit forms (gdn_triton.COMMIT_FORM): replay, chunk")
    parser.add_argument("--lengths", default="1,8,16", help="accepted path lengths (root included)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=256, help="the DDTree rounds' budget (and the verified tree's)")
    parser.add_argument("--reps", type=int, default=30, help="commits timed per setting and length")
    parser.add_argument("--rounds", type=int, default=3, help="generations per setting and method, interleaved")
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    forms = args.forms.split(",")
    if not set(forms) <= {"replay", "chunk"}:
        parser.error(f"--forms {args.forms!r}: each must be replay or chunk")
    settings = [(int(b), form) for form in forms for b in args.branches.split(",")]  # (streams, commit form)
    lengths = [int(n) for n in args.lengths.split(",")]
    device = torch.device("cuda")

    bandwidth = copy_bandwidth()
    model = build_random_target(args.shape, torch.bfloat16, device)
    drafter = build_random_drafter(args.shape, model)
    vocab, taps = model.config.vocab_size, drafter.spec.target_layer_ids
    prompt = torch.randint(1, vocab - 1, (1, args.context), device=device)
    targets = {setting: StaticTarget(model, taps, graphs=True) for setting in settings}
    # from peaked distributions, so that the best-first tree reaches its depth (paths of up to 16 nodes)
    log_probs = torch.log_softmax(torch.randn(MAX_PATH - 1, vocab, device=device) * 30, dim=-1)
    tree = build_tree(log_probs, TreeParams(args.budget, max_depth=MAX_PATH - 1)).to(device)
    deepest = int(tree.depths.argmax()) + 1  # node indices count the root as 0
    chain = torch.nonzero(tree.visibility[deepest])[:, 0]  # the root's path to the deepest node
    lengths = [n for n in lengths if n <= chain.shape[0]]
    capacity = args.context + args.budget + 1 + max(lengths) * (args.reps + 2) * len(lengths)
    for target in targets.values():
        target.start(capacity=capacity, max_verify=args.budget + 1)
        target.prefill(prompt)
    state = next(iter(targets.values())).state
    state_bytes = sum(s.numel() * s.element_size() for s in state.states.values())
    floor_us = 2 * state_bytes / bandwidth * 1e6
    floor = (f"{len(state.states)} GDN layers, {state_bytes / 1e6:.0f} MB of state; copy bandwidth "
             f"{bandwidth / 1e12:.2f} TB/s -> a commit's floor {floor_us:.0f} us (the state read and written once)"
             if state.states else "no GDN layers: a commit is the accepted K/V rows' move")
    print(f"{args.shape}: {floor}; verified tree of {args.budget} nodes")

    samples = {(b, form, n): [] for b, form in settings for n in lengths}
    for rep in range(args.reps + 2):  # the first two: the eager commit that is then captured, and a warm replay
        for n in lengths:
            for b, form in settings:  # both read when a commit runs eagerly or is captured; replays keep them
                loop.COMMIT_BRANCHES, gdn_triton.COMMIT_FORM = b, form
                target = targets[b, form]
                target.verify_tree(prompt[0, -1], tree)
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                target.commit(chain[:n])
                end.record()
                end.synchronize()
                if rep >= 2:
                    samples[(b, form, n)].append(begin.elapsed_time(end) * 1e3)
    print(f"{'path':>5} " + " ".join(f"{f'{b} stream(s), {form}, us':>26}" for b, form in settings))
    for n in lengths:
        print(f"{n:>5} " + " ".join(f"{quartiles(samples[(b, form, n)]):>26}" for b, form in settings))

    config = GenerationConfig(max_new_tokens=args.new_tokens)
    methods = [("dflash", dflash.generate, DFlashParams()), (f"ddtree B={args.budget}", ddtree.generate,
                                                             TreeParams(args.budget))]
    rounds = [(b, form, beside) for beside in (False, True) for b, form in settings]
    labels = [f"{b} stream(s), {form}{', beside' if beside else ''}" for b, form, beside in rounds]
    print(f"{'ms/round':>14} " + " ".join(f"{label:>30}" for label in labels) + "  same tokens, tokens a round")
    for name, engine, params in methods:
        per_round, tokens, accepted = {key: [] for key in rounds}, {}, []
        for rep in range(args.rounds + 1):  # the first: warm-up (captures)
            for b, form, beside in rounds:
                loop.COMMIT_BRANCHES, gdn_triton.COMMIT_FORM, generation.COMMIT_BESIDE_DRAFT = b, form, beside
                out = engine(targets[b, form], drafter, prompt, config, params)
                tokens[(b, form, beside)] = out.token_ids
                accepted += out.acceptance_lengths
                if rep:
                    per_round[(b, form, beside)].append(out.decode_s / max(out.num_rounds, 1) * 1e3)
        same = all(t == tokens[rounds[0]] for t in tokens.values())
        spread = {key: f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})" for key, v in per_round.items()}
        print(f"{name:>14} " + " ".join(f"{spread[key]:>30}" for key in rounds)
              + f"  {same}, {statistics.mean(accepted):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
