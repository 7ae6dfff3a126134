"""Hybrid (GDN) targets on CUDA: correctness checks and tau-independent costs, one table each.

    python benchmarks/hybrid_cuda.py [--context 1024] [--reps 5]

A small random Qwen3.5-style hybrid (or Qwen3-Next where transformers has no qwen3_5), built from
config on the GPU:
1. float32 on CUDA: StaticTarget's logits against transformers' plain forward; greedy DFlash and
   DDTree against greedy AR with a random drafter (token for token);
2. the same model split over cuda:0 and the CPU (half the layers each, lm_head and drafter on the
   CPU): tree logits equal the one-device run, so hidden states and taps cross devices correctly;
3. bf16: verify time for q = 1..256 tree nodes after a ``--context``-token prompt, commit time,
   the allocator's peak during a pass against ``tree_state_bytes``; transformers' own forward for
   comparison (one decode token and the prompt), which is where the missing fast kernels show.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import time

import torch

from workers.decoding import ar, ddtree, dflash
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import DFlashParams, TreeParams
from workers.decoding.tree import build_tree
from workers.models.drafter import DFlashDrafter
from workers.models.drafter_config import DrafterSpec
from workers.models.gdn import full_state_bytes, tree_state_bytes
from workers.models.runner.target import StaticTarget


def hybrid_config(vocab: int = 32000):
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)],
    )
    try:
        return AutoConfig.for_model("qwen3_5_text", **common)
    except (KeyError, ValueError):
        return AutoConfig.for_model("qwen3_next", **common, num_experts=0)


def drafter_for(config, device, dtype) -> DFlashDrafter:
    raw = {
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "intermediate_size": 3072,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
        "num_target_layers": config.num_hidden_layers, "block_size": 16, "rms_norm_eps": 1e-6,
        "dflash_config": {"mask_token_id": config.vocab_size - 1, "target_layer_ids": [1, 5]},
    }
    return DFlashDrafter(DrafterSpec.from_dict(raw)).to(device=device, dtype=dtype).eval()


def timed(fn, reps: int, sync) -> float:
    fn()
    sync()
    samples = []
    for _ in range(reps):
        begin = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples) * 1e3


@torch.inference_mode()
def correctness(config, device) -> list[str]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval()
    drafter = drafter_for(config, device, torch.float32)
    target = StaticTarget(model, drafter.spec.target_layer_ids, prefill_chunk=64, graphs=False)
    rows = []
    ids = torch.randint(1, config.vocab_size - 1, (1, 200), device=device)
    target.start(capacity=256, max_verify=8)
    chain = target.verify_chain(ids[0])
    reference = model(ids).logits[0]
    rows.append("fp32 cuda: chain logits vs transformers forward, max |diff| "
                f"{(chain.logits - reference).abs().max().item():.2e}"
                f" (logit scale {reference.abs().max().item():.1f})")
    graphed = StaticTarget(model, drafter.spec.target_layer_ids, prefill_chunk=64, graphs=True)
    same, runs, accepted, graph_same = 0, 0, 0, 0
    for seed in range(4):
        prompt = torch.randint(1, config.vocab_size - 1, (1, 40 + 30 * seed), device=device)
        cfg = GenerationConfig(max_new_tokens=48, seed=seed)
        want = ar.generate(target, None, prompt, cfg).token_ids
        graph_same += ar.generate(graphed, None, prompt, cfg).token_ids == want
        for engine, params in ((dflash.generate, DFlashParams()), (ddtree.generate, TreeParams(64)),
                               (ddtree.generate, TreeParams(256, branching=8))):
            out = engine(target, drafter, prompt, cfg, params)
            same += out.token_ids == want
            runs += 1
            accepted += sum(out.acceptance_lengths) - len(out.acceptance_lengths)
            graph_same += engine(graphed, drafter, prompt, cfg, params).token_ids == out.token_ids
    rows.append(f"fp32 cuda: greedy DFlash/DDTree == AR in {same}/{runs} runs ({accepted} drafted tokens accepted); "
                f"CUDA-graph runs == eager runs in {graph_same}/{runs + 4}")

    # split: layers 4.. and the head on the CPU; drafter beside lm_head
    split = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    split.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    split.model.embed_tokens.to(device)
    for layer in split.model.layers[:4]:
        layer.to(device)
    split.model.rotary_emb.to(device)
    cpu_drafter = drafter_for(config, "cpu", torch.float32)
    cpu_drafter.load_state_dict(drafter.state_dict())
    two = StaticTarget(split, drafter.spec.target_layer_ids, tap_device=torch.device("cpu"))
    one = StaticTarget(model, drafter.spec.target_layer_ids, graphs=False)
    tree = build_tree(torch.log_softmax(torch.randn(15, config.vocab_size) * 3, dim=-1), TreeParams(48))
    outs = []
    for runner in (one, two):
        runner.start(capacity=256, max_verify=64)
        runner.prefill(ids[:, :100])
        outs.append(runner.verify_tree(torch.tensor(7), tree))
    diff = (outs[0].logits.cpu() - outs[1].logits.cpu()).abs().max().item()
    tap_diff = (outs[0].taps.cpu() - outs[1].taps.cpu()).abs().max().item()
    devices = sorted({str(d) for d in two.layer_devices})
    prompt = torch.randint(1, config.vocab_size - 1, (1, 64), device=device)
    cfg = GenerationConfig(max_new_tokens=32)
    split_ok = ddtree.generate(two, cpu_drafter, prompt.cpu(), cfg, TreeParams(32)).token_ids == \
        ar.generate(one, None, prompt, cfg).token_ids
    rows.append(f"split over {devices}: tree logits max |diff| {diff:.2e}, taps {tap_diff:.2e}; "
                f"split DDTree == one-device AR: {split_ok}")
    return rows


@torch.inference_mode()
def costs(config, device, context: int, reps: int) -> list[str]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()
    sync = torch.cuda.synchronize
    target = StaticTarget(model, prefill_chunk=256, graphs=False)
    graphed = StaticTarget(model, prefill_chunk=256, graphs=True)
    prompt = torch.randint(1, config.vocab_size - 1, (1, context), device=device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = [f"bf16 model: {weights / 2**30:.2f} GiB weights, {len(target.gdn_ids)} GDN + "
            f"{len(target.attention_ids)} attention layers; prompt {context} tokens"]
    rows.append(f"{'q':>5} {'verify ms':>10} {'graph ms':>9} {'commit ms':>10} {'graph commit':>13} "
                f"{'peak extra MiB':>15} {'tree_state MiB':>15} {'full-state MiB':>15}")
    for q in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        target.start(capacity=context + 300, max_verify=q)
        target.prefill(prompt)
        kept = [0]
        if q == 1:
            verify = lambda: target.verify_chain(prompt[0, :1])  # noqa: E731
        else:
            tree = build_tree(torch.log_softmax(torch.randn(15, config.vocab_size) * 3, dim=-1), TreeParams(q - 1))
            node = int(tree.depths.argmax()) + 1  # commit the path to the deepest node
            while node > 0:
                kept.insert(1, node)
                node = int(tree.parents[node])
            tree = tree.to(device)
            verify = lambda: target.verify_tree(prompt[0, 0], tree)  # noqa: E731
        verify_ms = timed(verify, reps, sync)
        graphed.start(capacity=context + 300, max_verify=q)
        graphed.prefill(prompt)
        graph_verify = ((lambda: graphed.verify_chain(prompt[0, :1])) if q == 1
                        else (lambda: graphed.verify_tree(prompt[0, 0], tree)))
        graph_ms = timed(graph_verify, reps, sync)
        for _ in range(3):  # the first commit of a (width, length) runs eagerly and is captured; then replays
            graph_verify()
            sync()
            begin = time.perf_counter()
            graphed.commit(torch.tensor(kept))
            sync()
            graph_commit_ms = (time.perf_counter() - begin) * 1e3
        sync()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        verify()
        peak = torch.cuda.max_memory_allocated() - before
        begin = time.perf_counter()
        target.commit(torch.tensor(kept))
        sync()
        commit_ms = (time.perf_counter() - begin) * 1e3
        rows.append(f"{q:>5} {verify_ms:>10.2f} {graph_ms:>9.2f} {commit_ms:>10.2f} {graph_commit_ms:>13.2f} "
                    f"{peak / 2**20:>15.1f} "
                    f"{tree_state_bytes(config, q) / 2**20:>15.2f} {full_state_bytes(config, q) / 2**20:>15.1f}")

    from transformers import DynamicCache

    def hf_prefill():
        model(prompt, use_cache=True)

    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=config)
    out = model(prompt, use_cache=True, **{cache_kwarg: cache})
    cache = getattr(out, "cache", None) or out.past_key_values
    next_id = prompt[:, -1:]

    def hf_decode():  # grows the cache by one each call; fine for timing a handful of reps
        model(next_id, use_cache=True, **{cache_kwarg: cache})

    def our_prefill():
        target.start(capacity=context + 8, max_verify=1)
        target.prefill(prompt)

    rows.append(f"transformers forward: prompt {timed(hf_prefill, reps, sync):.1f} ms, one decode token "
                f"{timed(hf_decode, reps, sync):.2f} ms;  StaticTarget prefill {timed(our_prefill, reps, sync):.1f} ms")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    import transformers

    device = torch.device("cuda")
    config = hybrid_config()
    kernels = {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}
    header = [f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}, "
              f"model_type {config.model_type}; fast kernels present: {kernels}"]
    rows = header + correctness(config, device) + costs(config, device, args.context, args.reps)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
