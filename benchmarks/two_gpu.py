"""A hybrid target split over two GPUs through the real loading path (placement plan -> device_map).

    python benchmarks/two_gpu.py [--dtype float32]

Writes a random ~0.5B Qwen3.5-style hybrid checkpoint and a DFlash drafter to a temp folder, loads
them with ``Worker(WorkerConfig(gpus=2))`` (``workers.models.placement`` plans the split, the drafter goes
with lm_head), prints where every layer landed, and runs AR and DDTree trials on the split target:
greedy DDTree must equal AR (lossless_match 1.0) and the logits must equal a one-GPU copy's.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from workers.decoding.params import DFlashParams, TreeParams
from workers.models.drafter import DFlashDrafter
from workers.models.drafter_config import DrafterSpec
from workers.models.loading import save_drafter
from workers.models.runner.target import StaticTarget
from workers.prompts import Prompt
from workers.wire import TrialSpec, WorkerConfig
from workers.worker import Worker


def write_checkpoints(folder: Path) -> tuple[Path, Path]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)],
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder / "target")
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": 32000, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 128, "num_target_layers": 8, "block_size": 16, "rms_norm_eps": 1e-6,
        "dflash_config": {"mask_token_id": 31999, "target_layer_ids": [1, 5]},
    }
    save_drafter(DFlashDrafter(DrafterSpec.from_dict(raw)), folder / "drafter", raw)
    return folder / "target", folder / "drafter"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    print(f"{torch.cuda.device_count()} GPUs: "
          f"{[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, drafter_dir = write_checkpoints(Path(tmp))
        worker = Worker(WorkerConfig(target=str(target_dir), drafter=str(drafter_dir), dtype=args.dtype, device="cuda",
                                     gpus=2, local_files_only=True)).load()
        target = worker.target
        print("layer devices:", [str(d) for d in target.layer_devices])
        print("embed", target.device, "lm_head", target.lm_head.weight.device, "drafter",
              worker.drafter.fc.weight.device, "| graphs:", target.graphs)
        generator = torch.Generator().manual_seed(0)
        prompts = tuple(Prompt(input_ids=tuple(torch.randint(1, 31000, (200,), generator=generator).tolist()))
                        for _ in range(3))
        for spec in (TrialSpec(TreeParams(64), prompts, max_new_tokens=64, stop_token_ids=()),
                     TrialSpec(DFlashParams(), prompts, max_new_tokens=64, stop_token_ids=())):
            result = worker.run_trial(spec)
            m = result.metrics
            print(f"{spec.method.value}: status {result.status} {result.error or ''} "
                  f"lossless_match {m.get('lossless_match')} "
                  f"tau {m.get('tau', 0):.2f} tokens/s {m.get('tokens_per_s', 0):.1f} "
                  f"peak GiB dev0 {m.get('peak_memory_gib_dev0')} dev1 {m.get('peak_memory_gib_dev1')} "
                  f"tree_state_bytes {m.get('tree_state_bytes')}")
        # the same weights on one GPU: logits of a tree pass must agree
        single = type(worker.model).from_pretrained(target_dir, dtype=worker.model.dtype, device_map={"": 0}).eval()
        one = StaticTarget(single, graphs=False)
        ids = torch.tensor([prompts[0].input_ids])
        with torch.inference_mode():
            outs = []
            for runner in (one, StaticTarget(worker.model, graphs=False)):
                runner.start(capacity=512, max_verify=32)
                runner.prefill(ids)
                outs.append(runner.verify_chain(ids[0, :16].cuda()).logits.float().cpu())
        print(f"split vs one-GPU verify logits: max |diff| {(outs[0] - outs[1]).abs().max().item():.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
