"""GDN (Gated DeltaNet, the layers Qwen3.5 / Qwen3.6 / Qwen3-Next call ``linear_attention``) over a tree or a chain.

A GDN layer carries two things from token to token: the last K-1 inputs of a depthwise causal
convolution (the conv window) and a recurrent state S [H, dk, dv]. Per token t, with q, k
l2-normalised and q scaled by dk^-1/2, g_t <= 0 a log decay and beta_t in (0, 1):

    S' = exp(g_t) S_parent ;  delta_t = beta_t (v_t - S'^T k_t) ;  S_t = S' + k_t delta_t^T ;  o_t = S_t^T q_t

In a draft tree every node continues its *parent's* state, so siblings must not see one another.
Instead of materialising S for every node (B x layers x H x dk x dv: ~150 MB per node on a 27B
hybrid) we use the closed form, with "earlier" replaced by "ancestor". With G_t the sum of g over
t's path (t included) and r_t = beta_t (v_t - exp(G_t) S_0^T k_t):

    S_t = exp(G_t) S_0 + sum_{j in path(t)} exp(G_t - G_j) k_j delta_j^T
    delta_t + sum_{j strict ancestor of t} beta_t exp(G_t - G_j) (k_t . k_j) delta_j = r_t

A node's equations involve only its own path, which in a DDTree tree is at most ``MAX_PATH`` nodes
(depth <= 15). So ``tree_delta_rule`` works per node on that path alone: with x_m the delta of t's
m-th ancestor (m = 0 is t), the path's system is (I + U) x = r with U upper unit-triangular of size
<= MAX_PATH, and the output is o_t = exp(G_t) S_0^T q_t + e^T x, e_m = exp(G_t - G_{a_m}) (q_t . k_{a_m}).
Solving w^T (I + U) = e^T by forward substitution gives o_t = exp(G_t) S_0^T q_t + w . r_path: per
node a [P, P] Gram matrix of its path's keys, P scalar steps and one weighted sum of P rows of r.
The cost follows the tree (q nodes x P ancestors), nothing per node is larger than a token's own
vectors, and no node's state is formed. On CUDA a Triton kernel (``workers.models.gdn_triton``) solves
16 nodes at a time on the slots ``tree_blocks`` gives their paths; the torch form here is the
reference and the CPU path.

A chain (the prompt, a commit's replay, a long chain verify) uses the chunked form instead
(``chain_delta_rule``): the same closed form inside chunks of ``CHUNK`` tokens, the state carried from
chunk to chunk, ending in the state after the last token. After the acceptance walk the runner
replays the accepted path as such a chain from the committed state, so a verify pass only has to
keep each node's conv input, decay and beta (``PendingLayer``).

Everything runs in float32 like the reference kernels; inputs may be in any dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.models.kernels import triton_available
from workers.models.tree_blocks import tree_blocks

MAX_PATH = 16  # nodes on a root-to-node path that a tree pass handles (tree depth <= 15)
CHUNK = 64  # tokens per chunk of the chunked chain form
GATHER_BYTES = 256 * 2**20  # cap on the torch tree form's gathered [heads, q, P, dv] float32 rows


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# -- the shape of a pass -------------------------------------------------------------------------------
def ancestor_table(parents: torch.Tensor, width: int = MAX_PATH) -> torch.Tensor:
    """[q, width] long: column m is node t's m-th ancestor (0 = t itself), q (a sentinel) past the root.

    ``width`` must exceed the tree's depth (checked on the host only for CPU tensors).
    """
    q = parents.shape[0]
    step = torch.cat((torch.where(parents >= 0, parents, q), parents.new_full((1,), q)))  # sentinel maps to itself
    columns = [torch.arange(q, device=parents.device)]
    for _ in range(width - 1):
        columns.append(step[columns[-1]])
    table = torch.stack(columns, dim=1)
    if parents.device.type == "cpu" and q and bool((step[table[:, -1]] < q).any()):
        raise ValueError(f"tree deeper than {width - 1}: raise MAX_PATH")
    return table


@dataclass
class TreeShape:
    """Per-pass tree structure shared by every GDN layer of the pass (built once per pass).

    parents:   [q]           parent of each node, -1 for the first
    lag_index: [q, K]        rows of cat(conv window, node inputs) each node's conv reads
    ancestors: [q, MAX_PATH] from ``ancestor_table``; None for a chain handled in chunked form
    chain:     the nodes are a chain (known on the host): the conv is one batched causal conv
    commits:   the pass keeps its nodes as it goes (a prompt chunk, AR's token): no tree kernel, no blocks
    block_slots, block_mask: ``tree_blocks(ancestors)`` for the CUDA tree kernel of a pass that does not
               commit (None on the CPU, without ancestors, or for a committing pass)
    """

    parents: torch.Tensor
    lag_index: torch.Tensor
    ancestors: torch.Tensor | None
    chain: bool
    commits: bool = False
    block_slots: torch.Tensor | None = None
    block_mask: torch.Tensor | None = None

    @classmethod
    def build(cls, parents: torch.Tensor, window: int, chain: bool, commits: bool = False) -> TreeShape:
        q = parents.shape[0]
        if chain and q > MAX_PATH:  # the chunked form: no ancestors
            return cls(parents, conv_lag_index(parents, window), None, chain, commits)
        if parents.is_cuda and not commits and window > 0 and triton_available():  # the tree kernel's pass
            from workers.models.tree_shape_triton import tree_shape

            ancestors, lag_index, slots, mask = tree_shape(parents, window, MAX_PATH)  # two launches, not ~70
            return cls(parents, lag_index, ancestors, chain, commits, slots, mask)
        shape = cls(parents, conv_lag_index(parents, window), ancestor_table(parents), chain, commits)
        return shape.with_blocks() if parents.is_cuda else shape

    def with_blocks(self) -> TreeShape:
        """This shape with the tree kernel's blocks, if its pass runs that kernel and they are missing."""
        if self.ancestors is not None and not self.commits and self.block_slots is None:
            self.block_slots, self.block_mask = tree_blocks(self.ancestors)
        return self

    def to(self, device: torch.device) -> TreeShape:
        if torch.device(device).type == "cuda" and not self.parents.is_cuda:  # CPU-built, CUDA-used: as built there
            return TreeShape.build(self.parents.to(device), self.lag_index.shape[1] - 1, self.chain, self.commits)
        moved = [None if x is None else x.to(device)
                 for x in (self.parents, self.lag_index, self.ancestors, self.block_slots, self.block_mask)]
        return TreeShape(*moved[:3], self.chain, self.commits, *moved[3:])


# -- the short convolution ---------------------------------------------------------------------------
def conv_lag_index(parents: torch.Tensor, window: int) -> torch.Tensor:
    """[q, window+1] rows into ``cat(conv_window, node_inputs)``: column l is the input l steps back.

    parents: [q] parent of each node (-1 for the first node, whose predecessor is the newest input of
    the committed conv window). Row t, column 0 is node t itself (row ``window + t``).
    """
    q = parents.shape[0]
    device = parents.device
    # predecessor of every row of the extended input: committed rows step back one; nodes go to their parent
    committed_prev = torch.clamp(torch.arange(window, device=device) - 1, min=0)
    node_prev = torch.where(parents >= 0, parents + window, torch.full_like(parents, window - 1))
    prev = torch.cat((committed_prev, node_prev))
    lags = [torch.arange(window, window + q, device=device)]
    for _ in range(window):
        lags.append(prev[lags[-1]])
    return torch.stack(lags, dim=1)


def tree_conv(
    node_inputs: torch.Tensor,  # [q, C]
    conv_window: torch.Tensor,  # [window, C] committed inputs, oldest first
    weight: torch.Tensor,  # [C, window+1] depthwise kernel
    bias: torch.Tensor | None,
    lag_index: torch.Tensor,  # [q, window+1] from conv_lag_index
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(causal depthwise conv) of each node over its own ancestry; returns (out [q, C], extended inputs)."""
    extended = torch.cat((conv_window.to(node_inputs.dtype), node_inputs))  # [window+q, C]
    taps = extended[lag_index]  # [q, window+1, C], tap l = input l steps back
    out = torch.einsum("tlc,cl->tc", taps.to(weight.dtype), weight.flip(-1))
    if bias is not None:
        out = out + bias
    return F.silu(out), extended


def chain_conv(
    node_inputs: torch.Tensor,  # [q, C] a chain after the committed window
    conv_window: torch.Tensor,  # [window, C]
    weight: torch.Tensor,  # [C, window+1]
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tree_conv`` for a chain as one depthwise conv1d; returns (out [q, C], extended inputs)."""
    extended = torch.cat((conv_window.to(node_inputs.dtype), node_inputs))  # [window+q, C]
    out = F.conv1d(extended.T[None].to(weight.dtype), weight[:, None], bias, groups=weight.shape[0])
    return F.silu(out[0].T), extended


def window_after(extended: torch.Tensor, lag_index: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """The conv window [window, C] once ``node`` ([1] index tensor) is committed: its last
    ``window`` inputs, oldest first. (Indexing with a tensor, not a Python int, keeps it capturable.)"""
    rows = lag_index.index_select(0, node.view(1))[0, :-1].flip(0)
    return extended[rows]


# -- the delta rule over a tree --------------------------------------------------------------------------
def _normalized(query: torch.Tensor, key: torch.Tensor, repeat: int) -> tuple[torch.Tensor, torch.Tensor]:
    """l2-normalised float32 q (scaled by dk^-1/2) and k, one row per value head: [H, q, dk] each."""
    dk = query.shape[-1]
    q_ = l2_normalize(query.float()).repeat_interleave(repeat, dim=1).transpose(0, 1) * dk**-0.5
    k_ = l2_normalize(key.float()).repeat_interleave(repeat, dim=1).transpose(0, 1)
    return q_, k_


def tree_delta_rule(
    query: torch.Tensor,  # [q, Hk, dk]
    key: torch.Tensor,  # [q, Hk, dk]
    value: torch.Tensor,  # [q, H, dv]
    log_gate: torch.Tensor,  # [q, H] g <= 0
    beta: torch.Tensor,  # [q, H]
    state: torch.Tensor,  # [H, dk, dv] committed recurrent state (float32)
    ancestors: torch.Tensor,  # [q, P] from ancestor_table
    use_triton: bool | None = None,  # None: on CUDA when Triton imports and the head sizes fit its tiles
) -> torch.Tensor:
    """Outputs [q, H, dv] (float32) of every node, each from its own path; see the module docstring."""
    dk = query.shape[-1]
    q_ = (l2_normalize(query.float()) * dk**-0.5).transpose(0, 1)  # [Hk, q, dk]
    k_ = l2_normalize(key.float()).transpose(0, 1)
    return tree_delta_rule_normalized(q_, k_, value.float().transpose(0, 1), log_gate, beta, state, ancestors,
                                      use_triton)


def tree_delta_rule_normalized(
    q_: torch.Tensor,  # [Hk, q, dk] float32, l2-normalised and scaled by dk^-1/2
    k_: torch.Tensor,  # [Hk, q, dk] float32, l2-normalised
    v_: torch.Tensor,  # [H, q, dv] float32
    log_gate: torch.Tensor,  # [q, H]
    beta: torch.Tensor,  # [q, H]
    state: torch.Tensor,  # [H, dk, dv]
    ancestors: torch.Tensor,  # [q, P]
    use_triton: bool | None = None,
) -> torch.Tensor:
    """``tree_delta_rule`` after the l2 norms, heads first (what the conv prologue kernel writes)."""
    key_heads, q, dk = k_.shape
    num_heads, dv = v_.shape[0], v_.shape[-1]
    repeat = num_heads // key_heads  # grouped heads: each q/k head serves `repeat` value heads
    if use_triton is None:
        use_triton = v_.is_cuda and kernel_fits(dk, dv) and triton_available()
    if use_triton:  # [Hk, 2, q, dk]: k_ then q_, per key head, as the conv prologue kernel writes them
        from workers.models.gdn_triton import tree_outputs

        kq = torch.stack((k_, q_), dim=1)
        return tree_outputs(kq, v_, log_gate, beta, state, ancestors)
    sentinel = torch.zeros(num_heads, 1, dtype=torch.float32, device=v_.device)
    G = torch.cat((log_gate.float().T, sentinel), dim=1)[:, ancestors].sum(-1)  # [H, q] path sums
    # the committed state read once per node and head, as one product per key head over its value heads
    S0 = state.float().view(key_heads, repeat, dk, dv).transpose(1, 2).reshape(key_heads, dk, repeat * dv)
    products = torch.bmm(torch.cat((k_, q_), dim=1), S0).view(key_heads, 2 * q, repeat, dv)
    k_S0, q_S0 = products.transpose(1, 2).reshape(num_heads, 2 * q, dv).split(q, dim=1)  # [H, q, dv] each
    beta_ = beta.float().T.contiguous()  # [H, q]
    rhs = beta_[:, :, None] * (v_ - G.exp()[:, :, None] * k_S0)
    q_, k_ = q_.repeat_interleave(repeat, dim=0), k_.repeat_interleave(repeat, dim=0)
    out = torch.empty_like(rhs)
    step = max(1, GATHER_BYTES // max(1, q * ancestors.shape[1] * dv * 4))
    for h in range(0, num_heads, step):
        hs = slice(h, h + step)
        out[hs] = _path_outputs(q_[hs], k_[hs], rhs[hs], q_S0[hs], G[hs], beta_[hs], ancestors)
    return out.transpose(0, 1)


def _path_outputs(q_, k_, rhs, q_S0, G, beta, ancestors) -> torch.Tensor:
    """The per-node path solve in torch for heads [h, q, ...]; returns outputs [h, q, dv]."""
    heads, q = G.shape
    P = ancestors.shape[1]
    valid = ancestors < q  # [q, P]

    def on_path(x: torch.Tensor) -> torch.Tensor:  # [h, q, ...] -> [h, q, P, ...], zero past the root
        padded = torch.cat((x, x.new_zeros(heads, 1, *x.shape[2:])), dim=1)
        return padded[:, ancestors]

    keys, G_path, beta_path = on_path(k_), on_path(G), on_path(beta)  # [h, q, P, dk], [h, q, P]
    gram = keys @ keys.transpose(-1, -2)  # [h, q, P, P]
    qk = (keys @ q_[:, :, :, None])[..., 0]  # [h, q, P]
    # U[m, n] = beta_{a_m} exp(G_{a_m} - G_{a_n}) k_{a_m}.k_{a_n} for n > m on the path (masked before exp)
    upper = torch.ones(P, P, dtype=torch.bool, device=valid.device).triu(1) & valid[:, None, :]  # [q, P, P]
    decay = (G_path[..., :, None] - G_path[..., None, :]).masked_fill(~upper, float("-inf")).exp()
    U = beta_path[..., :, None] * decay * gram
    e = ((G[:, :, None] - G_path).masked_fill(~valid, float("-inf")).exp() * qk)  # [h, q, P]
    w = e.clone()
    for n in range(1, P):  # forward substitution: w_n = e_n - sum_{m<n} w_m U[m, n]
        w[..., n] -= (w[..., :n] * U[..., :n, n]).sum(-1)
    return G.exp()[:, :, None] * q_S0 + (w[..., None] * on_path(rhs)).sum(-2)


def kernel_fits(dk: int, dv: int) -> bool:
    """The Triton kernel's tiles: powers of two, at least 16 (its Gram product is a tensor-core tile)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (dk, dv))


# -- the delta rule over a chain (chunked) ----------------------------------------------------------------
def chain_delta_rule(
    query: torch.Tensor,  # [q, Hk, dk]
    key: torch.Tensor,  # [q, Hk, dk]
    value: torch.Tensor,  # [q, H, dv]
    log_gate: torch.Tensor,  # [q, H]
    beta: torch.Tensor,  # [q, H]
    state: torch.Tensor,  # [H, dk, dv] state before the first token
    with_outputs: bool = True,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(outputs [q, H, dv] float32 or None, state [H, dk, dv] after the last token) of q tokens in a line.

    Inside each chunk of C tokens, with gamma the chunk-local cumulative decay and T = (I + A)^-1
    (A_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j, j < i), the deltas are U - W S with U = T (beta v)
    and W = T (beta exp(gamma) k) for all chunks at once; only S is carried chunk to chunk.
    Padding tokens (k = v = beta = g = 0) change nothing.
    """
    q_, k_ = _normalized(query, key, value.shape[1] // query.shape[1])
    return chain_delta_rule_normalized(q_, k_, value.float().transpose(0, 1), log_gate, beta, state, with_outputs,
                                       chunk, repeated=True)


def chain_delta_rule_normalized(
    q_: torch.Tensor,  # [Hk, q, dk] (or [H, q, dk] with repeated=True) float32, normalised, q scaled
    k_: torch.Tensor,
    v_: torch.Tensor,  # [H, q, dv] float32
    log_gate: torch.Tensor,  # [q, H]
    beta: torch.Tensor,  # [q, H]
    state: torch.Tensor,  # [H, dk, dv]
    with_outputs: bool = True,
    chunk: int = CHUNK,
    repeated: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``chain_delta_rule`` after the l2 norms, heads first (what the conv prologue kernel writes)."""
    num_heads, length = v_.shape[:2]
    if not repeated:
        repeat = num_heads // q_.shape[0]
        q_, k_ = q_.repeat_interleave(repeat, dim=0), k_.repeat_interleave(repeat, dim=0)
    C = max(1, min(chunk, length))
    N = -(-length // C)
    pad = N * C - length

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [length, H, ...] -> [H, N, C, ...]
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, 0, 0, pad)) if pad else x
        return x.reshape(N, C, *x.shape[1:]).movedim(2, 0)

    q_, k_ = chunks(q_.transpose(0, 1)), chunks(k_.transpose(0, 1))  # [H, N, C, dk]
    v_ = chunks(v_.transpose(0, 1))
    b_ = chunks(beta.float()[..., None])[..., 0]  # [H, N, C]
    gamma = chunks(log_gate.float()[..., None])[..., 0].cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=v_.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, N, C, C]
    A = (b_[..., None] * decay * (k_ @ k_.transpose(-1, -2))).masked_fill(~causal.tril(-1), 0.0)
    rhs = torch.cat((b_[..., None] * v_, (b_ * gamma.exp())[..., None] * k_), dim=-1)
    UW = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # the diagonal is read as 1
    U, W = UW.split((v_.shape[-1], k_.shape[-1]), dim=-1)
    scores = decay * (q_ @ k_.transpose(-1, -2)) if with_outputs else None  # masked: decay is 0 above
    last = gamma[..., -1]  # [H, N]
    tail = (last[..., None] - gamma).exp()[..., None] * k_  # [H, N, C, dk] weights into the chunk's end state
    S = state.float()
    outputs = []
    for n in range(N):
        delta = U[:, n] - W[:, n] @ S  # [H, C, dv]
        if with_outputs:
            outputs.append(gamma[:, n].exp()[..., None] * (q_[:, n] @ S) + scores[:, n] @ delta)
        S = last[:, n].exp()[:, None, None] * S + tail[:, n].transpose(1, 2) @ delta
    out = torch.cat(outputs, dim=1)[:, :length].transpose(0, 1) if with_outputs else None
    return out, S


# -- what a verify pass keeps until the commit ---------------------------------------------------------
@dataclass
class PendingLayer:
    """What one linear layer keeps from a verify pass until the commit (the replay's inputs)."""

    extended: torch.Tensor  # [window+q, C] committed conv window, then each node's conv input (model dtype)
    lag_index: torch.Tensor  # [q, window+1] rows of ``extended`` each node's conv reads
    log_gate: torch.Tensor  # [q, H] float32 per-node log decay g
    beta: torch.Tensor  # [q, H] per-node beta (model dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.extended, self.lag_index, self.log_gate, self.beta))


def tree_state_bytes(config, nodes: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes a verify pass of ``nodes`` tokens keeps until the commit: every linear layer's
    ``PendingLayer``. (The per-node path solve's transients are a layer's own and freed with it.)"""
    cfg = getattr(config, "text_config", None) or config
    layers = sum(kind == "linear_attention" for kind in cfg.layer_types)
    heads, key_heads = cfg.linear_num_value_heads, cfg.linear_num_key_heads
    window = cfg.linear_conv_kernel_dim - 1
    conv_dim = 2 * key_heads * cfg.linear_key_head_dim + heads * cfg.linear_value_head_dim
    element = torch.empty((), dtype=dtype).element_size()
    per_layer = element * (window + nodes) * conv_dim + 8 * nodes * (window + 1) + (4 + element) * nodes * heads
    return layers * per_layer


def full_state_bytes(config, nodes: int) -> int:
    """What keeping a float32 recurrent state per node would cost instead (the naive fork)."""
    cfg = getattr(config, "text_config", None) or config
    layers = sum(kind == "linear_attention" for kind in cfg.layer_types)
    return nodes * layers * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
