"""One GPU call: the engines in bf16 on CUDA with a random Qwen3-shaped model, a real CUDA OOM
inside a worker trial, and the memory tracer. Prints a table; asserts nothing but exits 1 on a crash.

    python benchmarks/cuda_smoke.py [--layers 28 --hidden 2048]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from tools.tiny import write_tiny_pair
from workers.decoding import ar, ddtree, dflash
from workers.decoding.generation import GenerationConfig, StageTimer, device_sync
from workers.decoding.params import DFlashParams, TreeParams
from workers.memory import MemoryTracer
from workers.metrics import summarize
from workers.models.drafter import DFlashDrafter
from workers.models.drafter_config import DrafterSpec
from workers.models.runner.target import make_target
from workers.prompts import Prompt
from workers.wire import TrialSpec, WorkerConfig
from workers.worker import Worker


def random_pair(layers: int, hidden: int, vocab: int, device: torch.device):
    heads = hidden // 128
    base = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=heads,
                num_key_value_heads=max(1, heads // 4), head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                max_position_embeddings=8192, tie_word_embeddings=False)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(num_hidden_layers=layers, **base), dtype=torch.bfloat16)
    raw = base | {"num_hidden_layers": 5, "num_target_layers": layers, "block_size": 16,
                  "dflash_config": {"mask_token_id": vocab - 1}}
    drafter = DFlashDrafter(DrafterSpec.from_dict(raw)).to(device=device, dtype=torch.bfloat16).eval()
    return model.eval(), drafter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    model, drafter = random_pair(args.layers, args.hidden, args.vocab, device)
    target = make_target(model, drafter.spec.target_layer_ids)
    prompt = torch.randint(0, args.vocab - 2, (1, args.prompt_length))
    config = GenerationConfig(args.max_new_tokens)
    print(f"target {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params bf16, prompt {args.prompt_length}")

    runs = [("ar", ar.generate, None, None), ("dflash", dflash.generate, drafter, DFlashParams())]
    runs += [(f"ddtree B={b}", ddtree.generate, drafter, TreeParams(b)) for b in (16, 64, 256, 1024)]
    baseline = None
    print(f"{'setting':>14} {'tok/s':>8} {'tau':>5} {'ms/round':>9} {'draft':>6} {'tree':>6} {'verify':>7} "
          f"{'commit':>7} {'match':>6} {'peak GiB':>9}")
    for name, generate, draft, params in runs:
        generate(target, draft, prompt, GenerationConfig(16), params)  # warm-up
        with MemoryTracer(interval_ms=20) as tracer:
            untimed = generate(target, draft, prompt, config, params)
        timed = generate(target, draft, prompt, config, params, StageTimer(device_sync(device)))
        baseline = baseline or [untimed]
        m = summarize([untimed], baseline)
        ms_round = 1000 * untimed.decode_s / untimed.num_rounds
        total = sum(timed.stage_times.values())
        shares = [f"{100 * timed.stage_times.get(s, 0) / total:5.1f}%" for s in ("draft", "tree", "verify", "commit")]
        print(f"{name:>14} {m['tokens_per_s']:8.1f} {m['tau']:5.2f} {ms_round:9.2f} {shares[0]:>6} {shares[1]:>6} "
              f"{shares[2]:>7} {shares[3]:>7} {m['lossless_match']:6.2f} {tracer.trace.peak_gib:9.2f}")
    del model, drafter, target
    torch.cuda.empty_cache()

    # A real CUDA OOM inside a worker trial: a tree budget whose verify mask cannot be allocated.
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, drafter_dir = write_tiny_pair(Path(tmp))
        worker = Worker(WorkerConfig(str(target_dir), str(drafter_dir), dtype="float32", device="cuda")).load()
        prompts = (Prompt(input_ids=(1, 2, 3, 4, 5, 6)),)
        started = time.perf_counter()
        oom = worker.run_trial(TrialSpec(TreeParams(300_000), prompts, max_new_tokens=16))
        after = worker.run_trial(TrialSpec(TreeParams(32), prompts, max_new_tokens=16))
        print(f"oom trial: status={oom.status} peak_memory_gib={oom.metrics['peak_memory_gib']:.2f} "
              f"({time.perf_counter() - started:.1f}s); next trial: status={after.status} "
              f"lossless_match={after.metrics.get('lossless_match')} samples={len(after.memory_trace.samples)} "
              f"note={after.memory_trace.note!r}")


if __name__ == "__main__":
    main()
