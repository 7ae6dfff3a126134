"""Training a DFlash drafter on its target's own greedy output (the demo pair's second half).

At decoding time a drafter pass anchored at position a sees the target's taps of positions 0..a-1
as context and the block [token_a, MASK x (b-1)] at positions a..a+b-1, and must predict tokens
a+1..a+b-1 of what the target will commit. For greedy decoding that is the target's own greedy
continuation, so the training data is exactly that: corpus windows continued greedily by the target
(``DrafterData.from_target``), with the taps of the whole sequence from one batched forward.

A training step takes a few sequences, a few random anchors in each one's generated part (random
anchors, as SpecForge's DFlash trainer), and runs the drafter's own modules over all of a
sequence's blocks at once: one context of the sequence's taps, every block seeing the context
before its anchor and the whole of its own block, nothing of the other blocks (``block_hidden``).
Labels are the same positions' tokens, the anchor excluded, weighted exp(-(k-1)/gamma) by distance k.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.drafter import DFlashDrafter


class Ticker:
    """One progress line per phase every ``every`` seconds (and at the end), so a first
    ``make demo`` is never silent for minutes."""

    def __init__(self, phase: str, total: int, every: float = 5.0) -> None:
        self.phase, self.total, self.every = phase, total, every
        self.start = self.last = time.monotonic()

    def tick(self, done: int, note: str = "") -> None:
        now = time.monotonic()
        if done < self.total and now - self.last < self.every:
            return
        self.last, elapsed = now, now - self.start
        eta = elapsed / max(done, 1) * (self.total - done)
        print(f"  {self.phase} {done}/{self.total}  {note}  {elapsed:.0f}s elapsed, ~{eta:.0f}s left", flush=True)

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.start


def drafter_config(target_config: dict, recipe, mask_token_id: int) -> dict:
    """The drafter's config.json (z-lab layout): the target's Qwen3 fields at ``drafter_layers`` layers."""
    return target_config | {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": recipe.drafter_layers,
        "num_target_layers": recipe.num_layers,
        "block_size": recipe.block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(recipe.target_layer_ids)},
    }


@torch.no_grad()
def greedy_continue(model: nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """prompts [N, P] -> [N, P + new_tokens]: the target's greedy continuation (a KV-cached loop; eos
    does not stop it, what follows eos is still the target's own output)."""
    # transformers renamed ``past_key_values`` to ``cache`` (5.2x); the project supports both
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=prompts, use_cache=True)
    cache, token = getattr(out, name), out.logits[:, -1].argmax(-1, keepdim=True)  # [N, 1]
    pieces = [prompts, token]
    for _ in range(new_tokens - 1):
        out = model(input_ids=token, use_cache=True, **{name: cache})
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        pieces.append(token)
    return torch.cat(pieces, dim=1)


@torch.no_grad()
def taps_of(model: nn.Module, sequences: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """[N, L] -> [N, L, k*H]: hidden states after the given layers (hidden_states[i + 1]; index 0 is
    the embedding output), concatenated as the drafter reads them."""
    hidden = model(input_ids=sequences, output_hidden_states=True).hidden_states
    return torch.cat([hidden[i + 1] for i in layer_ids], dim=-1)


@dataclass
class DrafterData:
    tokens: torch.Tensor  # [N, L] corpus window (prompt_len) + the target's greedy continuation
    taps: torch.Tensor  # [N, L, k*H]
    prompt_len: int

    @classmethod
    def from_target(cls, model: nn.Module, stream: torch.Tensor, recipe, batch: int = 32) -> DrafterData:
        generator = torch.Generator().manual_seed(recipe.seed + 1)
        count, length = recipe.data_sequences, recipe.data_prompt_len
        starts = torch.randint(0, stream.numel() - length, (count,), generator=generator).tolist()
        windows = torch.stack([stream[s : s + length] for s in starts])  # [N, P]
        tokens, taps = [], []
        ticker = Ticker("greedy continuations", count)
        for begin in range(0, count, batch):
            sequences = greedy_continue(model, windows[begin : begin + batch], recipe.data_new_tokens)
            tokens.append(sequences)
            taps.append(taps_of(model, sequences, recipe.target_layer_ids))
            ticker.tick(min(begin + batch, count))
        return cls(torch.cat(tokens), torch.cat(taps), length)


def block_hidden(
    drafter: DFlashDrafter,
    block_embeds: torch.Tensor,  # [m, b, H]: target embedding of [token_a, MASK...] per anchor
    taps: torch.Tensor,  # [L, k*H]: the sequence's taps
    anchors: torch.Tensor,  # [m]: block starts, each block sees context positions < its anchor
) -> torch.Tensor:
    """The drafter over m blocks of one sequence in one pass -> final-normed hidden states [m, b, H]."""
    if drafter.spec.selector is not None:  # its convolutions would reach across the packed blocks
        raise ValueError("training a DFlash2 drafter is not implemented (DFlash v1 drafters only)")
    m, b, width = block_embeds.shape
    length, device = taps.shape[0], taps.device
    context = drafter.hidden_norm(drafter.fc(taps))[None]  # [1, L, H]
    block_positions = (anchors[:, None] + torch.arange(b, device=device)).reshape(1, m * b)
    ctx_rope = drafter.rotary_emb(context, torch.arange(length, device=device)[None])
    block_rope = drafter.rotary_emb(block_embeds, block_positions)
    # query row (block i, offset j) sees context columns < anchor_i and the b columns of block i, and
    # within those what its layer's attention allows (causal, window: ``DFlashDrafter.layer_masks``)
    sees_context = torch.arange(length, device=device)[None, :] < anchors.repeat_interleave(b)[:, None]  # [m*b, L]
    block_of = torch.arange(m, device=device).repeat_interleave(b)
    sees_block = block_of[:, None] == block_of[None, :]  # [m*b, m*b]
    key_positions = torch.cat((torch.arange(length, device=device), block_positions[0]))
    masks = drafter.layer_masks(block_positions[0], key_positions, torch.cat((sees_context, sees_block), dim=1),
                                context.dtype)
    hidden = block_embeds.reshape(1, m * b, width)
    for layer, mask in zip(drafter.layers, masks):  # DFlashDrafter.forward's loop, context K/V uncached
        keys, values = layer.self_attn.key_value(context, *ctx_rope)
        hidden = hidden + layer.self_attn(layer.input_layernorm(hidden), block_rope, keys, values, mask)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return drafter.norm(hidden).reshape(m, b, width)


def init_drafter(drafter: DFlashDrafter, std: float = 0.02, seed: int = 0) -> None:
    """Matrices ~ N(0, std) as transformers initialises Qwen3; norm weights stay at one."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in drafter.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def train_drafter(drafter: DFlashDrafter, model: nn.Module, data: DrafterData, recipe) -> float:
    """Train ``drafter`` in place on ``data`` with the target's frozen embedding and lm_head; returns seconds."""
    init_drafter(drafter, seed=recipe.seed)
    drafter.to(data.tokens.device)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    for param in model.parameters():
        param.requires_grad_(False)
    b, mask_id, device = drafter.block_size, drafter.spec.mask_token_id, data.tokens.device
    weights = torch.exp(-torch.arange(b - 1, dtype=torch.float32, device=device) / recipe.loss_gamma)  # [b-1]
    count, length = data.tokens.shape
    first, last = data.prompt_len, length - b  # anchors in the generated part, whole block inside
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=recipe.drafter_lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, recipe.drafter_steps // 15)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / recipe.drafter_steps)))))
    generator = torch.Generator().manual_seed(recipe.seed + 2)
    ticker, loss_avg, accuracy = Ticker("drafter step", recipe.drafter_steps), None, 0.0
    drafter.train()
    for step in range(1, recipe.drafter_steps + 1):
        total, hits = 0.0, 0.0
        for pick in torch.randint(0, count, (recipe.drafter_batch,), generator=generator).tolist():
            tokens = data.tokens[pick]  # [L]
            anchors = first + torch.randperm(last - first + 1, generator=generator)[: recipe.anchors_per_sequence]
            anchors = anchors.to(device)
            block_ids = torch.full((anchors.numel(), b), mask_id, device=device)
            block_ids[:, 0] = tokens[anchors]
            labels = tokens[anchors[:, None] + torch.arange(1, b, device=device)]  # [m, b-1]
            with torch.no_grad():
                block_embeds = embed(block_ids)  # [m, b, H]
            hidden = block_hidden(drafter, block_embeds, data.taps[pick], anchors)
            logits = lm_head(hidden[:, 1:])  # [m, b-1, V]
            losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")  # [m, b-1]
            loss = (losses * weights).sum() / (weights.sum() * anchors.numel() * recipe.drafter_batch)
            loss.backward()
            total += loss.item()  # host read: the log line
            hits += (logits.argmax(-1)[:, 0] == labels[:, 0]).float().mean().item() / recipe.drafter_batch
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        loss_avg = total if loss_avg is None else 0.9 * loss_avg + 0.1 * total
        accuracy = 0.9 * accuracy + 0.1 * hits if step > 1 else hits
        ticker.tick(step, f"loss {loss_avg:.3f}  first-token accuracy {accuracy:.2f}")
    drafter.eval()
    return ticker.seconds
