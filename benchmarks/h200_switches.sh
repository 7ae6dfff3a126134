#!/usr/bin/env bash
# The GPU runs that decide the speed switches, kept here so a session that is lent a machine starts from
# them (benchmarks/results/wide_passes_h200.md, from the fifteenth session's section on):
#   attention_triton.SHARED           the attention's work shared among one round of programs (stream-K), or
#                                     that form chosen per pass shape on trial (None); off: on an H200 the
#                                     shared form lost at every pass shape timed (seventeenth session)
#   runner.loop.COMMIT_BRANCHES       a commit's pieces (the K/V move, each GDN layer) on several streams: 4
#   generation.COMMIT_BESIDE_DRAFT    the commit beside the next draft instead of after it: on (27B on an H200:
#                                     DFlash rounds 0.2 ms shorter; 8B on an H100: the same either way,
#                                     twenty-fourth session)
#   gdn_triton.COMMIT_FORM            a GDN layer's commit token by token ("replay") or in the regrouped form
#                                     ("chunk"): replay; on an H100 the chunk form lost on 4 streams at every
#                                     path length (twentieth session)
#   lt_product.TIMING                 how the products' chooser times its candidates: "eager" (each launched on
#                                     its own) or "graph" (replayed, as passes run them): eager; the 257-row
#                                     passes took the same time chosen either way, 8B and 27B on an H200, 27B
#                                     on an H100 (thirty-first session)
#   gdn_triton.TREE_FORM              the GDN tree kernel's step along dk, pipeline depth
#                                     and blocks a program: None, chosen per pass shape on trial ((32, 3, 1)
#                                     unless another is 3% faster); on an RTX A6000 (32, 2, 1) fits 3 programs
#                                     an SM instead of 2 (an H100: (64, 2, 1) 5% faster at 257 nodes,
#                                     twenty-eighth session; an A6000 not yet timed)
# A switch goes on only where its timing shows a gain and its GPU tests pass; on another GPU (an RTX A6000)
# `tests`, `stages`, `ab qwen3-8b` and, for the 27B's layers, `SHAPE=qwen3.6-27b-half ... commit` and
# `ab qwen3.6-27b-half` say whether the same holds there. The whole 27B shape (`commit`'s default,
# `ab qwen3.6-27b`, half of `goals`) is 55 GB of random weights on one GPU: not on one 48 GB card; its
# first 32 layers ("qwen3.6-27b-half") are about 33 GB with the drafter.
#
# Here (a machine with pip and the internet), once a session:
#   bash benchmarks/h200_switches.sh wheels      # .whl: fla-core, nvmath-python and their needs, for the device
# On the device (`run`, carry [".whl", ".device-cache"]), one or more modes a call, in order (their
# timeouts, in brackets, summed under the call's 600 s: e.g. `tests commit` as a first call):
#   bash benchmarks/h200_switches.sh tests       # the switches' GPU tests [220 s]
#   bash benchmarks/h200_switches.sh commit      # the commit kernels' GPU tests; commit_branches.py, $SHAPE or 27B [490 s]
#   bash benchmarks/h200_switches.sh kernel      # attention_kernels.py --shared: 8B, 27B, 8B prompt chunks [360 s]
#   bash benchmarks/h200_switches.sh ab SHAPE    # sustained.py, 256 and 257 rows, attention splits / chosen x2 [530 s]
#   bash benchmarks/h200_switches.sh goals       # issue 28's goal table on both shapes, with what is on [560 s]
#   bash benchmarks/h200_switches.sh profile     # kernels of the wide passes, stages of B = 256 / 1024 rounds [460 s]
#   bash benchmarks/h200_switches.sh tree        # the tree build per budget and count kernel; its GPU test [150 s]
#   bash benchmarks/h200_switches.sh stages      # the GDN tree kernel at 2 and 3 stages, its GPU tests [240 s]
#   bash benchmarks/h200_switches.sh beside      # 8B rounds with the commit in line / beside the draft [330 s]
#   bash benchmarks/h200_switches.sh suite       # every GPU test of tests/workers, then the kernels' resources [520 s]
#   bash benchmarks/h200_switches.sh first       # benchmarks/first_draft.py: 8B, then $SHAPE or 27B [400 s]
#   bash benchmarks/h200_switches.sh timing      # lt_product.TIMING: its GPU test; 257-row passes each way [520 s]
# Triton's compiled kernels outlive the machine: a call unpacks .device-cache/triton.tar.xz.part-* (if
# carried; or an older call's single triton.tar.xz) into a fixed folder (the cache records absolute paths)
# and leaves the grown cache in $OUT/triton.tar.xz.part-* (15 MB each: a file over 16 MiB does not come back);
# copy those back to .device-cache/ (replacing what is there) before the next call, so it compiles nothing twice.
set -euo pipefail
usage="usage: bash benchmarks/h200_switches.sh wheels | MODE... (tests, commit, kernel, ab SHAPE, goals, profile, tree, stages, beside, suite, first, timing)"
[ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }

if [ "$1" = wheels ]; then
  mkdir -p .whl
  # the device's Python (3.12, x86-64, manylinux); einops, torch and triton are already there
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "fla-core==0.6.0" "nvmath-python>=1.0,<2"
  du -sh .whl
  exit 0
fi

tests() {
  timeout 220 python3 -m pytest -q -n 8 -m gpu tests/workers/models/test_attention_triton.py \
    tests/workers/models/test_graphs.py tests/workers/models/test_streams.py tests/workers/models/test_gdn_triton.py
}
commit() {
  timeout 150 python3 -m pytest -q -n 8 -m gpu tests/workers/models/test_gdn_triton.py \
    tests/workers/models/test_graphs.py -k "commit or tree_kernel"
  timeout 340 python3 benchmarks/commit_branches.py --shape "${SHAPE:-qwen3.6-27b}" --branches 1,4 \
    --forms replay,chunk --lengths 1,8,16
}
kernel() {
  timeout 120 python3 benchmarks/attention_kernels.py --shape qwen3-8b --capacity 3072 \
    --qs 17,65,129,256,257 --choices 1 --ends --shared --programs 264,528
  timeout 120 python3 benchmarks/attention_kernels.py --shape qwen3.6-27b --capacity 3072 \
    --qs 65,129,257,513,1025 --choices 1 --ends --shared
  for length in 0 1000; do  # the 8B's 1024-token prompt chunk, first and after 1000 tokens
    timeout 60 python3 benchmarks/attention_kernels.py --shape qwen3-8b --capacity 3072 --causal --qs 1024 \
      --length $length --choices 1 --shared
  done
}
ab() {  # $1: the shape; the first run compiles both forms' kernels, which the rest find in the cache
  limit=170 turn=0
  for forms in "chosen splits" "splits chosen"; do
    turn=$((turn + 1))
    for form in $forms; do
      echo "== $1, turn $turn, attention form: $form"
      timeout $limit python3 benchmarks/sustained.py --shape "$1" --qs 256,257 --seconds 3 --attention-form $form
      limit=120
    done
  done
}
goals() {  # AR, the 17- and 257-row passes, prefill, DFlash and DDTree rounds (27B: B = 1024, out of reach, left out);
  # the 256- and 257-row passes profiled, for the goals' "products" bound (B = 255 and 256)
  timeout 210 python3 benchmarks/gpu_speed.py --shape qwen3-8b --qs 17,257 --budgets 255,256,1024 \
    --new-tokens 32 --reps 3 --profile 256,257
  timeout 350 python3 benchmarks/gpu_speed.py --shape qwen3.6-27b --qs 17,257 --budgets 255,256 \
    --new-tokens 32 --reps 2 --profile 256,257
}

profile() {  # where the wide passes and rounds spend their time now: kernel by kernel, stage by stage
  timeout 140 python3 benchmarks/round_gaps.py --shape qwen3-8b --method ddtree --budget 256 --budget 1024
  timeout 140 python3 benchmarks/gpu_speed.py --shape qwen3-8b --qs 257,1025 --only-forwards --reps 2 \
    --profile 257,1025 --top 30
  timeout 180 python3 benchmarks/gpu_speed.py --shape qwen3.6-27b --qs 257 --only-forwards --reps 2 \
    --profile 257 --top 40
}

tree() {  # with .device-run/tree_triton_*.py (say `git show HEAD~1:workers/decoding/tree_triton.py`; git ignores
          # the folder: add ".device-run" to the call's carry) timed beside the module
  base=(); for other in .device-run/tree_triton_*.py; do [ -f "$other" ] && base+=(--base "$other"); done
  timeout 90 python3 benchmarks/tree_build.py --wide-from 1,32,9999 --profile "${base[@]}"
  timeout 60 python3 -m pytest -q -m gpu tests/workers/decoding/test_tree.py
}

stages() {  # gdn_triton.TREE_FORM: the 27B's GDN heads, q = 17..1025, a bfloat16 model's kernel in each form
  timeout 120 python3 -m pytest -q -n 8 -m gpu tests/workers/models/test_gdn_triton.py -k "tree_kernel"
  timeout 120 python3 benchmarks/gdn_kernels.py --shape qwen3.6-27b --configs 32/3/4,32/2/4,64/2/4,32/3/4/2,32/2/4/2
}

beside() {  # generation.COMMIT_BESIDE_DRAFT on the 8B shape (no GDN layers: the commit is the K/V move): the
            # GPU's idle time by stage with it on and off (and the host's time from the read to the verify's launch:
            # commit after the read, tree, verify), then whole rounds A/B'd in one process
  timeout 80 python3 benchmarks/round_gaps.py --shape qwen3-8b --method ddtree --budget 256
  timeout 80 python3 benchmarks/round_gaps.py --shape qwen3-8b --method ddtree --budget 256 --in-line
  timeout 170 python3 benchmarks/commit_branches.py --shape qwen3-8b --branches 1,4 --forms replay --lengths 1 \
    --rounds 5
}

suite() {  # `make test-gpu` without its install (the device has no Ray, MLflow or Optuna): the files that hold GPU
           # tests, so none is collected that imports those
  timeout 420 python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider $(grep -rl "mark.gpu" tests/workers)
  # compiled into a cache of its own: the carried cache keeps cubins alone, and a test reads the IR
  TRITON_CACHE_DIR=$(mktemp -d) timeout 100 python3 -m pytest -q tests/workers/models/test_kernel_resources.py
}

first() {  # a generation's first draft in its three forms (one eager pass, the prompt's write eager or by a graph;
           # the graph also with the whole q/k/v product and 64-row chunks), and the decode time of whole
           # generations with the write eager and by a graph, AR beside
  timeout 180 python3 benchmarks/first_draft.py --shapes qwen3-8b --chunks 64
  timeout 220 python3 benchmarks/first_draft.py --shapes "${SHAPE:-qwen3.6-27b}" --chunks 64
}

timing() {  # the products chosen by eager timing and by graph replays: the same passes, each in its own process
            # (a process chooses once), in turn twice; the chooser's picks print at the end of each
  timeout 100 python3 -m pytest -q -m gpu tests/workers/models/test_lt_product.py -k "graph"
  for turn in 1 2; do
    for how in eager graph; do
      echo "== turn $turn, lt_product timing: $how"
      timeout 100 python3 benchmarks/gpu_speed.py --shape "${SHAPE:-qwen3.6-27b}" --qs 257 --only-forwards --reps 10 \
        --lt-timing $how
    done
  done
}

modes=()  # checked before anything runs
while [ $# -gt 0 ]; do
  case "$1" in
    tests|commit|kernel|goals|profile|tree|stages|beside|suite|first|timing) modes+=("$1"); shift ;;
    ab) [ $# -ge 2 ] || { echo "ab needs a shape: qwen3-8b, qwen3.6-27b or qwen3.6-27b-half" >&2; exit 2; }
        modes+=("ab $2"); shift 2 ;;
    *) echo "unknown mode $1; $usage" >&2; exit 2 ;;
  esac
done

cache=/tmp/h200-switches-triton
mkdir -p "$cache" /tmp/site
if compgen -G ".device-cache/triton.tar.xz.part-*" >/dev/null; then
  cat .device-cache/triton.tar.xz.part-* | tar xJf - -C "$cache"
elif [ -f .device-cache/triton.tar.xz ]; then  # an older call's cache in one file
  tar xJf .device-cache/triton.tar.xz -C "$cache"
fi
save_cache() {  # the IR beside each cubin is not needed to load it: only the cubin and its metadata travel
  if [ -n "${OUT:-}" ]; then
    find "$cache" -type f \( -name '*.ttir' -o -name '*.ttgir' -o -name '*.llir' -o -name '*.ptx' \
      -o -name '*.source' \) -delete
    # in parts of 15 MB: a file over 16 MiB does not come back from the device
    tar cJf - -C "$cache" . | split -b 15M - "$OUT/triton.tar.xz.part-" && du -ch "$OUT"/triton.tar.xz.part-* | tail -1
  fi
}
trap save_cache EXIT
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=.:benchmarks:/tmp/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$cache
set +e  # one measurement that fails or runs out of time leaves the next to run
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
for mode in "${modes[@]}"; do
  echo "==== $mode ($(date +%T))"
  $mode
done
