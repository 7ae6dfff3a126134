"""The seam between the decoding algorithms and the target model: the words both sides use.

The engines (``workers.decoding``) talk to a ``Target``: prefill the prompt, verify a chain or a
``DraftTree`` in one pass (a ``VerifyOutput`` back), commit the accepted nodes; or advance over
tokens already known to be kept (AR's round: the pass commits them as it goes). The runner that
implements it lives in ``workers.models`` (``runner.target.make_target``). Nothing here imports
either side, so imports run one way: shell -> decoding -> models -> seam.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from workers.errors import UnsupportedModelError

# model_type values whose every layer is softmax attention over a KV cache we can index.
ATTENTION_ONLY_TYPES = frozenset({"qwen3", "qwen3_moe", "qwen2", "qwen2_moe", "llama", "mistral"})
# model_type values mixing GDN (Gated DeltaNet; transformers' "linear_attention") and "full_attention" layers.
HYBRID_TYPES = frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"})
HYBRID_LAYER_TYPES = frozenset({"linear_attention", "full_attention"})


def text_config(config):
    """The language model's config (multimodal Qwen3.5 / 3.6 checkpoints nest it as ``text_config``)."""
    inner = getattr(config, "text_config", None)
    return inner if inner is not None else config


def attention_head_dim(cfg) -> int:
    """An attention head's size in a text config: its ``head_dim``, else hidden size / heads."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def is_hybrid(config) -> bool:
    return getattr(config, "model_type", None) in HYBRID_TYPES


def check_supported(config) -> None:
    """Refuse, by name, an architecture whose output the engines cannot guarantee to be exact."""
    model_type = getattr(config, "model_type", "?")
    supported = ", ".join(sorted(ATTENTION_ONLY_TYPES | HYBRID_TYPES))
    if model_type in HYBRID_TYPES:
        layer_types = set(getattr(text_config(config), "layer_types", None) or ())
        if not layer_types or not layer_types <= HYBRID_LAYER_TYPES:
            raise UnsupportedModelError(
                f"target architecture '{model_type}' with layer types {sorted(layer_types)} is not supported "
                f"(hybrid layers must be {sorted(HYBRID_LAYER_TYPES)})"
            )
        return
    if model_type not in ATTENTION_ONLY_TYPES:
        raise UnsupportedModelError(f"target architecture '{model_type}' is not supported (supported: {supported})")
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
        raise UnsupportedModelError(f"target architecture '{model_type}' with sliding-window layers is not supported")


@dataclass(frozen=True)
class VerifyOutput:
    logits: torch.Tensor  # [q, V] float, one row per verified node (root first)
    taps: torch.Tensor  # [1, q, k*H] hidden states after the tapped layers, on the drafter's device


class Target(Protocol):
    """What an engine needs from the target model (batch 1, one sequence at a time)."""

    model: torch.nn.Module
    device: torch.device
    graphs: bool  # verify passes replay CUDA graphs (then the drafter may replay its own)
    # the drafter's CUDA graphs, kept with the target's for as long as the target lives (filled and read
    # by ``workers.decoding.drafting``; None until a drafter first replays on this target)
    drafter_graphs: object | None

    def start(self, capacity: int, max_verify: int) -> None: ...
    def prefill(self, input_ids: torch.Tensor) -> VerifyOutput: ...
    def advance(self, tokens: torch.Tensor) -> VerifyOutput: ...  # tokens [q] kept whole: last logits [1, V]
    def verify_chain(self, tokens: torch.Tensor) -> VerifyOutput: ...
    def verify_tree(self, root_token: torch.Tensor, tree: DraftTree) -> VerifyOutput: ...
    def commit(self, kept: torch.Tensor) -> None: ...


class Timer(Protocol):
    """A stage timer (``workers.decoding.generation``): seconds per named stage of a round."""

    @property
    def totals(self) -> dict[str, float]: ...
    def stage(self, name: str) -> AbstractContextManager[None]: ...


@dataclass(frozen=True)
class DraftTree:
    """A drafted tree of n nodes plus the root (built on CPU; ``to`` moves it for verification).

    tokens:     [n]   token id of node i+1
    depths:     [n]   depth of node i+1 (root is depth 0, so these are >= 1)
    parents:    [n+1] parent index of each node; parents[0] = -1 for the root
    visibility: [n+1, n+1] bool, visibility[i, j] = j is i or an ancestor of i
    log_probs:  [n]   path log-probability of each node under the factorised drafter
    """

    tokens: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    visibility: torch.Tensor
    log_probs: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    def to(self, device: torch.device) -> DraftTree:
        """The same tree on ``device`` (one copy per round, shared by verify and the walk)."""
        return DraftTree(*(t.to(device, non_blocking=True) for t in
                           (self.tokens, self.depths, self.parents, self.visibility, self.log_probs)))


@dataclass(frozen=True)
class Lattice:
    """What a DFlash2 drafter's pass proposes for its n draft positions (``workers.models.drafter2``).

    tokens:    [n, K]    long, each position's candidates (the lm_head's top-K), best logit first
    log_probs: [n, K, K] float32, log_probs[j, p, c]: candidate c at position j after candidate p of
                         position j - 1 (the selector's distribution over the K; at position 0 every
                         row p is the anchor's)
    greedy:    [n]       long, the selector's greedy chain from the anchor (token ids)

    A DFlash round drafts ``greedy``; a DDTree round builds its tree from the lattice
    (``workers.decoding.tree.build_lattice_tree``).
    """

    tokens: torch.Tensor
    log_probs: torch.Tensor
    greedy: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    def __getitem__(self, rows: slice) -> Lattice:
        """The first positions (``lattice[:d]``): the greedy walk's prefix is the walk over them."""
        return Lattice(self.tokens[rows], self.log_probs[rows], self.greedy[rows])

    def clone(self) -> Lattice:
        return Lattice(self.tokens.clone(), self.log_probs.clone(), self.greedy.clone())

    def contiguous(self) -> Lattice:
        return Lattice(self.tokens.contiguous(), self.log_probs.contiguous(), self.greedy.contiguous())

    def copy_(self, other: Lattice) -> Lattice:
        """Overwrite in place (a captured graph's static inputs)."""
        self.tokens.copy_(other.tokens)
        self.log_probs.copy_(other.log_probs)
        self.greedy.copy_(other.greedy)
        return self

    def to(self, device) -> Lattice:
        return Lattice(self.tokens.to(device), self.log_probs.to(device), self.greedy.to(device))


Draft = torch.Tensor | Lattice  # a drafter pass's proposal: DFlash's draft logits [n, V], or DFlash2's Lattice
