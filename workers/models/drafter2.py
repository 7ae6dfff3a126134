"""The project's own DFlash2 drafter: DFlash's block pass with dynamic convolutions, then a candidate selector.

DFlash2 (architecture ``DFlash2DraftModel``) keeps everything of a DFlash drafter (``drafter.py``:
the target's taps through ``fc`` and ``hidden_norm`` as context K/V, the block [anchor, MASK...] in
the target's embedding, the target's lm_head) and adds two things:

- around every layer's attention and MLP, a grouped dynamic causal convolution (``GroupedDynamicConv``)
  mixes each block row with the rows before it: once on the sub-layer's normed input, once on its
  output before the residual add. Each tap's weight per channel is a learned base plus a delta per
  row and channel group, projected from the sub-layer's normed input. The taps stop at the block's
  first row (the anchor), and never reach the context;
- a candidate selector (``CandidateSelector``) over the lm_head's top-k tokens per draft position:
  the score of candidate c after token p at position j is c's logit plus a low-rank bilinear term
  <A[p] * g_j, B[c]> (A, B: predecessor and successor codebooks indexed by token id; g_j: a projection
  of position j's hidden state). Position 1's predecessor is the anchor, position j's the candidates
  of j - 1: the scores form a lattice (``workers.seam.Lattice``), in which a chain is one walk from
  the anchor and a tree a set of walks (``workers.decoding.tree.build_lattice_tree``).

Checkpoint layout (z-lab/*-DFlash2): DFlash's keys, plus ``layers.N.{attention,mlp}_conv.base_kernel``
[2, kernel, H] (side: 0 = the sub-layer's input, 1 = its output; tap 0 = the row itself, tap t = t
rows back), ``layers.N.{attention,mlp}_conv.kernel_projection.weight`` [2 * kernel * H / group, H]
(viewed as side, tap, group), ``candidate_selector.hidden_projection.weight`` [rank, H] and
``candidate_selector.{predecessor,successor}_codebook`` [vocab, rank] (no ``.weight``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from workers.models.drafter import DFlashDrafter, DrafterLayer
from workers.models.drafter_config import DrafterSpec, SelectorSpec
from workers.seam import Lattice


class GroupedDynamicConv(nn.Module):
    """A causal convolution over the block's rows whose per-channel taps = base + a per-row, per-group
    delta projected from the row's normed input. Used twice per sub-layer: ``weights`` once from its
    input, then ``mix`` on the input (side 0) and on the sub-layer's output (side 1)."""

    def __init__(self, hidden_size: int, selector: SelectorSpec) -> None:
        super().__init__()
        self.kernel, self.group = selector.conv_kernel_size, selector.conv_group_size
        self.groups = hidden_size // self.group
        self.base_kernel = nn.Parameter(torch.zeros(2, self.kernel, hidden_size))  # [side, tap, channel]
        self.kernel_projection = nn.Linear(hidden_size, 2 * self.kernel * self.groups, bias=False)

    def weights(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [1, b, H] -> every row's taps [1, b, 2 (side), kernel, H]."""
        delta = self.kernel_projection(normed).view(*normed.shape[:-1], 2, self.kernel, self.groups)
        return self.base_kernel + delta.repeat_interleave(self.group, dim=-1)

    @staticmethod
    def mix(rows: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        """rows [1, b, H], taps [1, b, kernel, H] (one side) -> sum over t of taps[:, i, t] * rows[:, i - t];
        rows before the block's first are zero."""
        out = rows * taps[:, :, 0]
        for t in range(1, taps.shape[2]):
            shifted = F.pad(rows, (0, 0, t, 0))[:, : rows.shape[1]]  # row i holds row i - t
            out = out + shifted * taps[:, :, t]
        return out


class DFlash2Layer(DrafterLayer):
    def __init__(self, cfg: Qwen3Config, selector: SelectorSpec) -> None:
        super().__init__(cfg)
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, selector)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, selector)

    def block_step(self, hidden: torch.Tensor, block_rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                   values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        taps = self.attention_conv.weights(normed)  # [1, b, 2, kernel, H]
        attended = self.self_attn(self.attention_conv.mix(normed, taps[:, :, 0]), block_rope, keys, values, mask)
        hidden = hidden + self.attention_conv.mix(attended, taps[:, :, 1])
        normed = self.post_attention_layernorm(hidden)
        taps = self.mlp_conv.weights(normed)
        return hidden + self.mlp_conv.mix(self.mlp(self.mlp_conv.mix(normed, taps[:, :, 0])), taps[:, :, 1])


class CandidateSelector(nn.Module):
    """The lattice of a pass's draft positions: each position's top-k candidates, and for every
    candidate of the position before (the anchor for the first) a distribution over them."""

    def __init__(self, hidden_size: int, vocab_size: int, selector: SelectorSpec) -> None:
        super().__init__()
        self.top_k = selector.selector_top_k
        self.hidden_projection = nn.Linear(hidden_size, selector.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, selector.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, selector.selector_rank))

    def forward(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor) -> Lattice:
        """hidden [n, H] (the draft rows' final-normed states), logits [n, V] (lm_head of them), anchor [1]."""
        unary, tokens = torch.topk(logits.float(), k=self.top_k, dim=-1)  # [n, K] best first
        predecessors = torch.cat((anchor.view(1, 1).expand(1, self.top_k), tokens[:-1]))  # [n, K]
        gate = self.hidden_projection(hidden).float()  # [n, r]
        before = self.predecessor_codebook[predecessors].float()  # [n, K (parent), r]
        after = self.successor_codebook[tokens].float()  # [n, K (child), r]
        scores = unary[:, None, :] + torch.einsum("npr,nr,ncr->npc", before, gate, after)  # [n, parent, child]
        return Lattice(tokens=tokens, log_probs=torch.log_softmax(scores, dim=-1), greedy=_walk(tokens, scores))


def _walk(tokens: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The greedy chain [n]: from the anchor, each position's best candidate after the one chosen
    before it (ties to the better logit). Stays on the device (no host read)."""
    state = torch.zeros(1, dtype=torch.long, device=scores.device)  # position 1: every parent row is the anchor
    picks = []
    for position in range(scores.shape[0]):
        state = scores[position].index_select(0, state).argmax(dim=-1)  # [1]
        picks.append(state)
    return tokens.gather(1, torch.cat(picks).unsqueeze(1)).squeeze(1)


class DFlash2Drafter(DFlashDrafter):
    """Parameter names match the z-lab DFlash2 safetensors keys exactly (no ``model.`` prefix)."""

    def __init__(self, spec: DrafterSpec) -> None:
        if spec.selector is None:
            raise ValueError("DFlash2Drafter needs a DFlash2 spec (architecture DFlash2DraftModel)")
        super().__init__(spec)
        cfg = spec.qwen3_config
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, spec.selector)

    def _new_layer(self) -> nn.Module:
        return DFlash2Layer(self.spec.qwen3_config, self.spec.selector)

    def propose(self, hidden: torch.Tensor, lm_head: nn.Module, anchor: torch.Tensor) -> Lattice:
        """The draft rows' lattice (``CandidateSelector``), on the drafter's device."""
        logits = lm_head(hidden.to(lm_head.weight.device)).to(hidden.device)
        return self.candidate_selector(hidden, logits, anchor.to(hidden.device))


def drafter_for(spec: DrafterSpec) -> DFlashDrafter:
    """The module a spec's checkpoint loads into: DFlash2 when it declares a selector, else DFlash."""
    return DFlashDrafter(spec) if spec.selector is None else DFlash2Drafter(spec)
