"""Small random models the project makes itself, for tests, the offline demo and CPU benchmarks.

``write_tiny_pair(folder)`` writes a Qwen3-style target (``folder/target``, transformers layout) and a
DFlash drafter for it (``folder/drafter``, z-lab layout). Weights are random but scaled up so logits
are well separated: greedy ties, which would make float32 exactness tests flaky, are then rare.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.drafter import DFlashDrafter, DrafterSpec, save_drafter


@dataclass(frozen=True)
class TinyShape:
    vocab_size: int = 32
    hidden_size: int = 32
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 64
    drafter_layers: int = 2
    block_size: int = 8
    init_std: float = 0.25


def tiny_target_config(shape: TinyShape) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": shape.vocab_size + 1,  # one spare row for the drafter's MASK token
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.hidden_size // shape.num_heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "initializer_range": shape.init_std,
        "eos_token_id": 0,
        "bos_token_id": 0,
    }


def tiny_drafter_config(shape: TinyShape) -> dict:
    config = tiny_target_config(shape) | {
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": shape.drafter_layers,
        "num_target_layers": shape.num_layers,
        "block_size": shape.block_size,
        "dflash_config": {
            "mask_token_id": shape.vocab_size,  # the spare embedding row
            "target_layer_ids": sorted({1, shape.num_layers - 2} if shape.num_layers > 2 else {0}),
        },
    }
    return config


def write_tiny_pair(folder: Path, shape: TinyShape = TinyShape(), seed: int = 0) -> tuple[Path, Path]:
    """Write target and drafter checkpoints under ``folder``; returns (target_dir, drafter_dir)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    target_dir, drafter_dir = folder / "target", folder / "drafter"
    target = AutoModelForCausalLM.from_config(Qwen3Config(**tiny_target_config(shape)), dtype=torch.float32)
    _spread(target, shape.init_std)
    target.save_pretrained(target_dir)

    raw = tiny_drafter_config(shape)
    drafter = DFlashDrafter(DrafterSpec.from_dict(raw))
    _spread(drafter, shape.init_std)
    save_drafter(drafter, drafter_dir, raw)
    return target_dir, drafter_dir


def _spread(module: torch.nn.Module, std: float) -> None:
    """Re-draw every matrix with a large std (norm weights stay at one)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std)


def write_prompts(path: Path, shape: TinyShape = TinyShape(), count: int = 8, length: int = 12, seed: int = 0) -> None:
    """A JSONL file of random token-id prompts for models without a tokenizer."""
    generator = torch.Generator().manual_seed(seed)
    with path.open("w") as handle:
        for _ in range(count):
            ids = torch.randint(1, shape.vocab_size, (length,), generator=generator).tolist()
            handle.write(json.dumps({"input_ids": ids}) + "\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.tiny FOLDER``: write the tiny target, drafter and a prompts file there."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m workers.tiny", description=main.__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    target_dir, drafter_dir = write_tiny_pair(args.folder, seed=args.seed)
    write_prompts(args.folder / "prompts.jsonl")
    print(f"wrote {target_dir}, {drafter_dir} and {args.folder / 'prompts.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
