"""Sampling from target logits: the one acceptance rule every engine shares.

Every engine commits only tokens the target itself sampled at a verified position, and accepts a
drafted token exactly when it equals that sample. With a point-mass (greedy) draft this *is*
rejection sampling, so output is distributed as plain autoregressive sampling at any temperature.
"""

from __future__ import annotations

import torch

GREEDY_BELOW = 1e-5  # temperatures below this mean argmax, as in the DFlash reference


def sample_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """logits [n, V] -> token ids [n] (long), argmax when temperature is ~0."""
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """One generator per prompt, seeded, on the device the logits live on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
