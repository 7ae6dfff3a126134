"""Small random models the project makes itself, for tests, the offline demo and CPU benchmarks.

``write_tiny_pair(folder)`` writes a target (``folder/target``, transformers layout: Qwen3 by default,
or a Qwen3.5 / Qwen3-Next hybrid with ``TinyShape(arch=...)``) and a DFlash drafter for it (``folder/drafter``,
z-lab layout; DFlash2 with ``TinyShape(dflash2=True)``). Weights are random but scaled up so logits
are well separated: greedy ties, which would make float32 exactness tests flaky, are then rare.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.models.drafter2 import drafter_for
from workers.models.drafter_config import DrafterSpec
from workers.models.loading import save_drafter


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
    arch: str = "qwen3"  # or "qwen3_5" / "qwen3_next": GDN layers alternating with attention
    gdn_key_heads: int = 2  # hybrids: GDN key heads
    gdn_value_heads: int = 4  # hybrids: GDN value heads (a multiple of the key heads)
    gdn_head_dim: int = 8  # hybrids: GDN key and value head size (16 or more: the Triton kernels' tiles fit)
    # the drafter's attention, written as z-lab checkpoints write it (drafter_config.resolve_layer_attention):
    drafter_layer_types: tuple[str, ...] | None = None  # e.g. ("sliding_attention", "full_attention")
    drafter_window: int | None = None  # sliding_window (with use_sliding_window: true)
    drafter_use_swa: bool = False  # dflash_config.use_swa: every layer sliding
    drafter_causal: bool | None = None  # dflash_config.causal: overrides every layer's causality
    # a DFlash2 drafter (DFlash2DraftModel: dynamic convolutions, a candidate selector) instead of DFlash
    dflash2: bool = False
    selector_top_k: int = 4
    selector_rank: int = 8
    conv_kernel_size: int = 2
    conv_group_size: int = 4


ARCHES = ("qwen3", "qwen3_5", "qwen3_next")


def tiny_target_config(shape: TinyShape) -> dict:
    if shape.arch not in ARCHES:
        raise ValueError(f"tiny arch must be one of {', '.join(ARCHES)}, got {shape.arch!r}")
    config = _qwen3_config(shape)
    if shape.arch == "qwen3":
        return config
    hybrid = {
        "layer_types": ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(shape.num_layers)],
        "linear_num_key_heads": shape.gdn_key_heads,
        "linear_num_value_heads": shape.gdn_value_heads,
        "linear_key_head_dim": shape.gdn_head_dim,
        "linear_value_head_dim": shape.gdn_head_dim,
        "linear_conv_kernel_dim": 4,
    }
    if shape.arch == "qwen3_5":
        return config | hybrid | {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"}
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 32}
    return config | hybrid | moe | {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}


def _qwen3_config(shape: TinyShape) -> dict:
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
    dflash = {
        "mask_token_id": shape.vocab_size,  # the spare embedding row
        "target_layer_ids": sorted({1, shape.num_layers - 2} if shape.num_layers > 2 else {0}),
    }
    config = _qwen3_config(shape) | {
        "architectures": ["DFlash2DraftModel" if shape.dflash2 else "DFlashDraftModel"],
        "num_hidden_layers": shape.drafter_layers,
        "num_target_layers": shape.num_layers,
        "block_size": shape.block_size,
    }
    if shape.drafter_layer_types is not None:
        config["layer_types"] = list(shape.drafter_layer_types)
    if shape.drafter_window is not None:
        config |= {"use_sliding_window": True, "sliding_window": shape.drafter_window}
    if shape.drafter_use_swa:
        dflash["use_swa"] = True
    if shape.drafter_causal is not None:
        dflash["causal"] = shape.drafter_causal
    if shape.dflash2:
        dflash |= {"conv_kernel_size": shape.conv_kernel_size, "conv_group_size": shape.conv_group_size,
                   "selector_rank": shape.selector_rank, "selector_top_k": shape.selector_top_k}
    return config | {"dflash_config": dflash}


def write_tiny_pair(folder: Path, shape: TinyShape = TinyShape(), seed: int = 0) -> tuple[Path, Path]:
    """Write target and drafter checkpoints under ``folder``; returns (target_dir, drafter_dir)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    target_dir, drafter_dir = folder / "target", folder / "drafter"
    raw_target = tiny_target_config(shape)
    config = AutoConfig.for_model(raw_target["model_type"],
                                  **{k: v for k, v in raw_target.items() if k != "model_type"})
    target = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _spread(target, shape.init_std)
    target.save_pretrained(target_dir)

    raw = tiny_drafter_config(shape)
    drafter = drafter_for(DrafterSpec.from_dict(raw))
    _spread(drafter, shape.init_std)
    save_drafter(drafter, drafter_dir, raw)
    return target_dir, drafter_dir


def distill_drafter(
    target_dir: Path, drafter_dir: Path, steps: int = 300, sequences: int = 32, seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
) -> None:
    """Train the tiny drafter briefly to predict the tiny target's own continuations, in place.

    A random drafter is accepted about 1/V of the time, which makes a demo sweep flat; a few hundred
    CPU steps of DFlash-style training (random anchors, block [token, MASK...], same-position labels,
    loss weight decaying with distance) lift tau well above 1 so tree settings matter.
    ``progress(phase, done, total)`` is called after each sequence ("generating") and each step
    ("training"), so a caller can show how far it is.
    """
    import torch.nn.functional as F

    from workers.decoding import ar
    from workers.decoding.generation import GenerationConfig
    from workers.models.loading import Placement, load_drafter, load_target
    from workers.models.runner.target import make_target

    torch.manual_seed(seed)
    model = load_target(str(target_dir), dtype="float32", placement=Placement(device="cpu"))
    drafter = load_drafter(str(drafter_dir), model)
    target = make_target(model, drafter.spec.target_layer_ids)
    vocab, block = model.config.vocab_size - 1, drafter.block_size
    texts, taps = [], []
    for index in range(sequences):  # half greedy, half sampled: the drafter sees both kinds of text
        prompt = torch.randint(1, vocab, (1, 8))
        config = GenerationConfig(48, temperature=0.0 if index % 2 == 0 else 0.8, seed=index)
        text = torch.cat((prompt[0], torch.tensor(ar.generate(target, None, prompt, config).token_ids)))
        with torch.no_grad():
            target.start(capacity=text.numel() + 1, max_verify=1)
            taps.append(target.prefill(text.unsqueeze(0)).taps)
        texts.append(text)
        if progress is not None:
            progress("generating", index + 1, sequences)
    target.close()

    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    weights = torch.exp(-torch.arange(block - 1) / 7.0)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    drafter.train()
    for step in range(steps):
        pick = int(torch.randint(len(texts), ()))
        text, tap = texts[pick], taps[pick]
        anchor = int(torch.randint(4, text.numel() - block, ()))
        block_ids = torch.full((1, block), drafter.spec.mask_token_id)
        block_ids[0, 0] = text[anchor]
        with torch.no_grad():
            block_embeds = embed(block_ids)
        hidden = drafter(block_embeds, tap[:, :anchor], drafter.new_cache(anchor + block))
        losses = F.cross_entropy(lm_head(hidden[0, 1:]), text[anchor + 1 : anchor + block], reduction="none")
        ((losses * weights).sum() / weights.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
        if progress is not None:
            progress("training", step + 1, steps)
    raw = json.loads((drafter_dir / "config.json").read_text())
    save_drafter(drafter.eval(), drafter_dir, raw)


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
    """``python -m tools.tiny FOLDER``: write the tiny target, drafter and a prompts file there."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tools.tiny", description=main.__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--distill-steps", type=int, default=600, help="drafter training steps (0: random drafter)")
    parser.add_argument("--distill-sequences", type=int, default=32,
                        help="target continuations the drafter learns from")
    parser.add_argument("--arch", choices=ARCHES, default="qwen3",
                        help="target architecture (hybrids: qwen3_5, qwen3_next)")
    args = parser.parse_args(argv)
    target_dir, drafter_dir = write_tiny_pair(args.folder, TinyShape(arch=args.arch), seed=args.seed)
    if args.distill_steps:
        _distill_with_progress(target_dir, drafter_dir, args.distill_steps, args.distill_sequences, args.seed)
    write_prompts(args.folder / "prompts.jsonl")
    print(f"wrote {target_dir}, {drafter_dir} and {args.folder / 'prompts.jsonl'}")
    return 0


def _distill_with_progress(target_dir: Path, drafter_dir: Path, steps: int, sequences: int, seed: int) -> None:
    """distill_drafter under a rich progress bar on stderr (the first `make demo` spends minutes here)."""
    import sys

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = Console(file=sys.stderr)
    console.print(f"training the tiny drafter on the tiny target's own text ({steps} steps on CPU) ...",
                  highlight=False)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("left"), TimeRemainingColumn())
    with Progress(*columns, console=console) as bar:
        tasks: dict[str, int] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(f"{phase} ", total=total)
            bar.update(tasks[phase], completed=done)

        distill_drafter(target_dir, drafter_dir, steps=steps, sequences=sequences, seed=seed, progress=update)


if __name__ == "__main__":
    raise SystemExit(main())
