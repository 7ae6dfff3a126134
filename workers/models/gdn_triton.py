"""GDN's per-token work as Triton kernels (CUDA only): the conv prologue, the tree solve, the gated norm.

``prologue``: per node, the conv over its ancestry, SiLU and the q/k l2 norms in one kernel (one
program per node and head), reading the committed conv window and the node inputs where they lie
(no concatenation) and, on request, writing their concatenation (what a pass keeps for its commit)
and the gates beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias). It replaces ~30 small
torch kernels. ``gated_norm``: the output's RMSNormGated in one. Both follow the torch path's
roundings to the model dtype, so they agree with it to rounding.

``tree_outputs``: the per-node path solve of ``workers.models.gdn.tree_delta_rule_normalized``
in blocks, one program per (block, value head) or per (two blocks, value head) (``TREE_FORM``): a block
is 16 nodes consecutive in depth-first order plus the ancestors of its first node
(``tree_blocks.tree_blocks``), which hold every path its nodes need. On those 32 slots a block's solve
forms the keys' Gram matrix, the path sums of the log decay, L (the paths' systems: each slot's row on its
strict ancestors) and the nodes' query weights e, then w = e (I + L)^-1 by the nilpotent product
(I - L)(I + L^2)(I + L^4)(I + L^8), and the outputs exp(G) q_ S0 + w r regrouped so that only the nodes'
rows meet the committed state S0: all tensor-core products of 32-wide tiles, nothing written but the
outputs. Where the root is apart from the
blocks (``tree_blocks.root_apart``), one more program per head gives its output. The torch form in
``gdn`` is the reference it is tested against (``tests/workers/models/test_gdn_triton.py``).

``commit_path``: after a pass, one layer's (state, conv window) advanced over the accepted path in one
kernel, token by token (``_commit_kernel``) or the whole path at once in the same regrouped form as the
tree solve (``_commit_chunk_kernel``); ``COMMIT_FORM`` picks.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from workers.models.pdl_triton import launch_options, wait_for_inputs
from workers.models.tree_blocks import TREE_BLOCK, tree_blocks

TREE_WARPS = 4
# The tree kernel's form: (its step along dk in the products with the committed state, the stages of its
# software pipeline over those steps: each step's slices of the state, keys and queries loaded that many
# steps ahead, 3 being Triton's default; the blocks a program takes, 1 or 2: with 2 each slice of the state
# is read once for two blocks). Every form gives the same bits: a block's products chain their sums through
# one accumulator whatever the step, each block's arithmetic is the same alone or paired, and the root's
# program sums in steps of ROOT_STEP in every form (with the form's step, 64 changed the last place of most
# of the root's outputs on an H100; with it, every form gave the same bits at 17-1025 nodes). At (32, 3, 1)
# a bfloat16 model's program takes 48 KB of shared memory, so an sm_86 or sm_89 SM (an RTX A6000's: 100 KB)
# holds 2; at (32, 2, 1) 32 KB and 3 fit, registers allowing; at (64, 2, 1) 50 KB, one on sm_86 and 3 on
# sm_90; paired blocks take ~206 registers, 2 programs on sm_90 (``benchmarks/kernel_resources.py``). On an
# H100 a 27B layer at 257 nodes took 32.1 / 30.5 us in (32, 3, 1) and (64, 2, 1), 38.2 / 38.4 paired
# (``benchmarks/gdn_kernels.py --configs``). By default (None) each tree-pass shape takes its form on trial
# on the GPU at hand (``chosen_form``): the first of FORM_CHOICES unless another gives the same bits and is
# FORM_MARGIN faster. A (step, stages, blocks) forces one. PAIRED_FORMS were slower at every width timed
# (17-1025 nodes, twenty-ninth session), so they stay out of the trial; an RTX A6000 has not timed them.
TREE_FORM: tuple[int, int, int] | None = None
ROOT_STEP = tl.constexpr(32)  # the root's program sums over dk in this step in every form (``_root_outputs``)
FORM_CHOICES = ((32, 3, 1), (32, 2, 1), (64, 2, 1))
PAIRED_FORMS = ((32, 3, 2), (32, 2, 2))
FORM_MARGIN = 0.03
# (device, the pass's shapes and forms) -> the form, kept for the process; and what each trial found
_FORMS: dict[tuple, tuple[int, int, int]] = {}
_FORM_TRIALS: dict[tuple, str] = {}
# A commit's form: "replay" (``_commit_kernel``, the path token by token) or "chunk" (``_commit_chunk_kernel``,
# the regrouped form, flat in the path's length). On an H100 the chunk form lost on 4 streams at every
# length, 1 to 16 nodes (``benchmarks/commit_branches.py --forms replay,chunk``; results in
# wide_passes_h200.md): replay stays. The chunk form's products run in float32 FMA ("ieee"), not tf32: the
# state it writes is carried into every later round.
COMMIT_FORM = "replay"
COMMIT_PRECISION = "ieee"
COMMIT_CHUNK_WARPS = 4
PROLOGUE_NODES = 4  # nodes per program of the conv prologue
PROLOGUE_WARPS = 1
NORM_HEADS = 16  # heads per program of the gated norm


@triton.jit
def _tree_block_kernel(
    KQ, V, STATE, LOG_GATE, BETA, SLOTS, MASK, OUT, Z, NORM_W, nodes, z_stride, eps, root_program, count,
    HEADS: tl.constexpr, REPEAT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, CONTEXT: tl.constexpr,
    BLOCK: tl.constexpr, BK: tl.constexpr, FACTORS: tl.constexpr, PRECISION: tl.constexpr, NORMED: tl.constexpr,
    PAIRS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (block b, value head h); with PAIRS, blocks 2b and 2b + 1 of the count, each slice of
    the state read once for both; or (b = root_program: the root apart from the blocks, head h).
    KQ [Hk, 2, q, DK] (k_, then q_; value head h reads key head h // REPEAT), V [H, q, DV], STATE [H,
    DK, DV] the committed state S0, LOG_GATE / BETA [q, H], SLOTS [n, S] (S = CONTEXT + BLOCK; the
    block's nodes in the last BLOCK slots), MASK [n, S, S] ancestor-or-self, from ``tree_blocks``. OUT
    [q, H, DV] float32; or, NORMED, [q, H*DV] in OUT's dtype after the gated norm of each row
    (``_gated_norm``'s, with Z [q, H*DV] (rows z_stride apart) and NORM_W [DV])."""
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    if b == root_program:
        _root_outputs(KQ, V, STATE, LOG_GATE, BETA, OUT, Z, NORM_W, h, nodes, eps, HEADS, REPEAT, DK, DV,
                      min(DK, ROOT_STEP), NORMED)
    elif PAIRS:
        _block_pair_outputs(KQ, V, STATE, LOG_GATE, BETA, SLOTS, MASK, OUT, Z, NORM_W, b, h, nodes, z_stride, eps,
                            count, HEADS, REPEAT, DK, DV, CONTEXT, BLOCK, BK, FACTORS, PRECISION, NORMED)
    else:
        _block_outputs(KQ, V, STATE, LOG_GATE, BETA, SLOTS, MASK, OUT, Z, NORM_W, b, h, nodes, z_stride, eps,
                       HEADS, REPEAT, DK, DV, CONTEXT, BLOCK, BK, FACTORS, PRECISION, NORMED)


@triton.jit
def _root_outputs(KQ, V, STATE, LOG_GATE, BETA, OUT, Z, NORM_W, h, nodes, eps, HEADS: tl.constexpr,
                  REPEAT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, NORMED: tl.constexpr):
    """The root's (node 0's) output for head h. Its path is itself, so the block form's sums hold one
    term: out = (exp(g) q - c k) S0 + a v with a = beta q.k and c = a exp(g); float32 products, summed over
    dk in steps of BK = ROOT_STEP whatever the form's step (a sum's order, so its bits, follows the step)."""
    d = tl.arange(0, DK)
    cols = tl.arange(0, DV)
    kq = KQ + (h // REPEAT) * 2 * nodes * DK
    decay = tl.exp(tl.load(LOG_GATE + h))
    a = tl.load(BETA + h).to(tl.float32) * tl.sum(tl.load(kq + nodes * DK + d) * tl.load(kq + d))
    out = a * tl.load(V + h * nodes * DV + cols)  # [DV]
    for step in range(0, DK, BK):
        ds = step + tl.arange(0, BK)
        state = tl.load(STATE + h * DK * DV + ds[:, None] * DV + cols[None, :])  # [BK, DV]
        q_eff = decay * tl.load(kq + nodes * DK + ds) - a * decay * tl.load(kq + ds)  # [BK]
        out += tl.sum(q_eff[:, None] * state, axis=0)
    out = out[None, :]  # [1, DV]: the row the norm and the store take
    if NORMED:
        z = tl.load(Z + h * DV + cols)[None, :]
        out = _gated_norm(out, z, tl.load(NORM_W + cols)[None, :], eps, OUT.dtype.element_ty, DV)
    tl.store(OUT + h * DV + cols[None, :], out)


@triton.jit
def _block_outputs(KQ, V, STATE, LOG_GATE, BETA, SLOTS, MASK, OUT, Z, NORM_W, b, h, nodes, z_stride, eps,
                   HEADS: tl.constexpr, REPEAT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   CONTEXT: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr, FACTORS: tl.constexpr,
                   PRECISION: tl.constexpr, NORMED: tl.constexpr):
    """The outputs of block b's nodes for head h."""
    out, c, node_decay, row, valid, node, is_node, node_row = _block_solve(
        KQ, V, LOG_GATE, BETA, SLOTS, MASK, b, h, nodes, HEADS, REPEAT, DK, DV, CONTEXT, BLOCK, FACTORS, PRECISION)
    kq = KQ + (h // REPEAT) * 2 * nodes * DK
    cols = tl.arange(0, DV)
    # over DK in steps of BK: a whole [DK, DV] float32 state tile would not fit an RTX A6000's shared
    # memory (99 KB a block) beside the other operands
    for step in range(0, DK, BK):
        ds = step + tl.arange(0, BK)
        state = tl.load(STATE + h * DK * DV + ds[:, None] * DV + cols[None, :])  # [BK, DV]
        out = _state_step(kq, state, out, c, node_decay, row, valid, node_row, is_node, ds, nodes, DK, PRECISION)
    _block_store(OUT, Z, NORM_W, out, h, node, is_node, node_row, z_stride, eps, HEADS, DV, NORMED)


@triton.jit
def _block_pair_outputs(KQ, V, STATE, LOG_GATE, BETA, SLOTS, MASK, OUT, Z, NORM_W, b, h, nodes, z_stride, eps,
                        count, HEADS: tl.constexpr, REPEAT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        CONTEXT: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr, FACTORS: tl.constexpr,
                        PRECISION: tl.constexpr, NORMED: tl.constexpr):
    """The outputs of blocks 2b and 2b + 1 for head h, as ``_block_outputs`` gives each, with each slice
    of the state loaded once for both: every program of a head reads the whole state, so pairs halve that
    traffic. Where the count is odd the last program's second block is its first again, computed twice and
    stored once (the second's stores masked off)."""
    second = 2 * b + 1 < count
    out0, c0, decay0, row0, valid0, node0, is_node0, node_row0 = _block_solve(
        KQ, V, LOG_GATE, BETA, SLOTS, MASK, 2 * b, h, nodes, HEADS, REPEAT, DK, DV, CONTEXT, BLOCK, FACTORS,
        PRECISION)
    out1, c1, decay1, row1, valid1, node1, is_node1, node_row1 = _block_solve(
        KQ, V, LOG_GATE, BETA, SLOTS, MASK, tl.minimum(2 * b + 1, count - 1), h, nodes, HEADS, REPEAT, DK, DV,
        CONTEXT, BLOCK, FACTORS, PRECISION)
    is_node1 = is_node1 & second
    kq = KQ + (h // REPEAT) * 2 * nodes * DK
    cols = tl.arange(0, DV)
    for step in range(0, DK, BK):
        ds = step + tl.arange(0, BK)
        state = tl.load(STATE + h * DK * DV + ds[:, None] * DV + cols[None, :])  # [BK, DV]
        out0 = _state_step(kq, state, out0, c0, decay0, row0, valid0, node_row0, is_node0, ds, nodes, DK, PRECISION)
        out1 = _state_step(kq, state, out1, c1, decay1, row1, valid1, node_row1, is_node1, ds, nodes, DK, PRECISION)
    _block_store(OUT, Z, NORM_W, out0, h, node0, is_node0, node_row0, z_stride, eps, HEADS, DV, NORMED)
    _block_store(OUT, Z, NORM_W, out1, h, node1, is_node1, node_row1, z_stride, eps, HEADS, DV, NORMED)


@triton.jit
def _block_solve(KQ, V, LOG_GATE, BETA, SLOTS, MASK, b, h, nodes, HEADS: tl.constexpr, REPEAT: tl.constexpr,
                 DK: tl.constexpr, DV: tl.constexpr, CONTEXT: tl.constexpr, BLOCK: tl.constexpr,
                 FACTORS: tl.constexpr, PRECISION: tl.constexpr):
    """Block b's path solve for head h, up to the products with the committed state: the outputs' value
    part sum_n a[t, n] v_n [BLOCK, DV], the weights c [BLOCK, S] of the slots' keys in each node's
    effective query, each node's exp(G_t) [BLOCK, 1], and the block's slot rows and node rows."""
    S: tl.constexpr = CONTEXT + BLOCK
    i = tl.arange(0, S)
    j = tl.arange(0, BLOCK) + CONTEXT  # the block's own slots: the nodes whose outputs this program writes
    d = tl.arange(0, DK)
    cols = tl.arange(0, DV)
    slot = tl.load(SLOTS + b * S + i)
    valid = slot < nodes
    row = tl.where(valid, slot, 0)
    node = tl.load(SLOTS + b * S + j)
    is_node = node < nodes
    node_row = tl.where(is_node, node, 0)
    on_path = tl.load(MASK + b * S * S + i[:, None] * S + i[None, :]) != 0  # [S, S] column on row's path
    node_path = tl.load(MASK + b * S * S + j[:, None] * S + i[None, :]) != 0  # [BLOCK, S]
    kq = KQ + (h // REPEAT) * 2 * nodes * DK
    keys = tl.load(kq + row[:, None] * DK + d[None, :], mask=valid[:, None], other=0.0)  # [S, DK]
    queries = tl.load(kq + (nodes + node_row[:, None]) * DK + d[None, :], mask=is_node[:, None], other=0.0)
    gram = tl.dot(keys, tl.trans(keys), input_precision=PRECISION)  # [S, S]
    qk = tl.dot(queries, tl.trans(keys), input_precision=PRECISION)  # [BLOCK, S]
    g = tl.load(LOG_GATE + row * HEADS + h, mask=valid, other=0.0)
    beta = tl.load(BETA + row * HEADS + h, mask=valid, other=0.0).to(tl.float32)
    G = tl.sum(tl.where(on_path, g[None, :], 0.0), axis=1)  # [S] each slot's path sum of g
    G_node = tl.sum(tl.where(node_path, g[None, :], 0.0), axis=1)  # [BLOCK]
    # L[m, n] = beta_m exp(G_m - G_n) k_m.k_n for n a strict ancestor of m (masked before exp): the
    # deltas solve (I + L) x = r. L is nilpotent (paths hold <= 2^FACTORS nodes: L^(2^FACTORS) = 0),
    # so (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...: 2 FACTORS - 1 small products, no substitution.
    strict = on_path & (i[:, None] != i[None, :])
    L = tl.where(strict, beta[:, None] * tl.exp(tl.where(strict, G[:, None] - G[None, :], 0.0)) * gram, 0.0)
    # the outputs' weights on the slots' deltas, e[t, n] = exp(G_t - G_n) q_t.k_n on t's path, then
    # w = e (I + L)^-1 weighs the right-hand sides r directly
    w = tl.where(node_path, tl.exp(tl.where(node_path, G_node[:, None] - G[None, :], 0.0)) * qk, 0.0)
    w = w - tl.dot(w, L, input_precision=PRECISION)
    power = L
    for _ in tl.static_range(FACTORS - 1):
        power = tl.dot(power, power, input_precision=PRECISION)
        w = w + tl.dot(w, power, input_precision=PRECISION)
    # out_t = exp(G_t) q_t S0 + sum_n w[t, n] r_n with r_n = beta_n (v_n - exp(G_n) k_n S0) regroups as
    # (exp(G_t) q_t - sum_n c[t, n] k_n) S0 + sum_n a[t, n] v_n, a = w beta, c = a exp(G): one product
    # with the state per node instead of one per slot and per node, and no [S, DV] slot rows held
    a = w * beta[None, :]  # [BLOCK, S]
    c = a * tl.exp(G)[None, :]
    values = tl.load(V + (h * nodes + row[:, None]) * DV + cols[None, :], mask=valid[:, None], other=0.0)
    out = tl.dot(a, values, input_precision=PRECISION)  # [BLOCK, DV]
    return out, c, tl.exp(G_node)[:, None], row, valid, node, is_node, node_row


@triton.jit
def _state_step(kq, state, out, c, node_decay, row, valid, node_row, is_node, ds, nodes, DK: tl.constexpr,
                PRECISION: tl.constexpr):
    """out += (exp(G_t) q_t - sum_n c[t, n] k_n) S0 over the dk slice ds of the queries, keys and state."""
    k_part = tl.load(kq + row[:, None] * DK + ds[None, :], mask=valid[:, None], other=0.0)  # [S, BK]
    q_part = tl.load(kq + (nodes + node_row[:, None]) * DK + ds[None, :], mask=is_node[:, None], other=0.0)
    q_eff = node_decay * q_part - tl.dot(c, k_part, input_precision=PRECISION)  # [BLOCK, BK]
    return tl.dot(q_eff, state, out, input_precision=PRECISION)


@triton.jit
def _block_store(OUT, Z, NORM_W, out, h, node, is_node, node_row, z_stride, eps, HEADS: tl.constexpr,
                 DV: tl.constexpr, NORMED: tl.constexpr):
    cols = tl.arange(0, DV)
    if NORMED:
        z = tl.load(Z + node_row[:, None] * z_stride + h * DV + cols[None, :], mask=is_node[:, None], other=0.0)
        out = _gated_norm(out, z, tl.load(NORM_W + cols)[None, :], eps, OUT.dtype.element_ty, DV)
    tl.store(OUT + (node[:, None] * HEADS + h) * DV + cols[None, :], out, mask=is_node[:, None])


def tree_outputs(
    kq: torch.Tensor,  # [Hk, 2, q, dk] float32: k_, then q_ (scaled by dk^-1/2), per key head
    v_: torch.Tensor,  # [H, q, dv] float32
    log_gate: torch.Tensor,  # [q, H] float32 per-node log decay g
    beta: torch.Tensor,  # [q, H]
    state: torch.Tensor,  # [H, dk, dv] float32 committed recurrent state
    ancestors: torch.Tensor,  # [q, P] (P = MAX_PATH)
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None,  # ``tree_blocks.tree_blocks(ancestors)`` if made already
    model_dtype: torch.dtype = torch.float32,
    num_warps: int | None = None,
    precision: str | None = None,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # (z [q, H*dv], weight [dv], eps)
    form: tuple[int, int, int] | None = None,  # (step, stages, blocks a program): TREE_FORM or chosen on trial
) -> torch.Tensor:
    """Outputs [q, H, dv] float32, as ``gdn.tree_delta_rule_normalized`` computes them; with
    ``norm``, ``gated_norm(outputs, z, weight, eps, model_dtype)`` [q, H*dv] instead, in the kernel's
    epilogue (the float32 outputs are never written).

    The products (the solve's and those with the committed state) run on tensor cores: in tf32 for a
    bfloat16 model (relative error ~1e-3, below the rounding of the outputs to bfloat16 that follows),
    otherwise in three-pass tf32, as accurate as float32 (``benchmarks/gdn_kernels.py`` prints both
    errors and times). ``precision`` overrides the choice.
    """
    key_heads, _, nodes, dk = kq.shape
    heads, dv = v_.shape[0], v_.shape[-1]
    kq = kq.contiguous()
    slots, mask = blocks if blocks is not None else tree_blocks(ancestors)
    count = slots.shape[0]
    apart = count * TREE_BLOCK < nodes  # the root left out of the blocks (``tree_blocks.root_apart``)
    precision = precision or ("tf32" if model_dtype == torch.bfloat16 else "tf32x3")
    v_, state, log_gate, beta = v_.contiguous(), state.contiguous(), log_gate.float().contiguous(), beta.contiguous()
    z, weight, eps = norm if norm is not None else (v_, v_, 0.0)  # without the norm, not read
    z = z if z.stride(-1) == 1 else z.contiguous()

    def launch(form: tuple[int, int, int]) -> torch.Tensor:
        step, stages, blocks_each = form
        programs = -(-count // blocks_each)
        if norm is None:
            out = torch.empty(nodes, heads, dv, dtype=torch.float32, device=v_.device)
        else:
            out = torch.empty(nodes, heads * dv, dtype=model_dtype, device=v_.device)
        _tree_block_kernel[(programs + apart, heads)](
            kq, v_, state, log_gate, beta, slots, mask.view(torch.uint8), out, z, weight, nodes, z.stride(0), eps,
            programs if apart else -1, count,
            HEADS=heads, REPEAT=heads // key_heads, DK=dk, DV=dv, CONTEXT=slots.shape[1] - TREE_BLOCK,
            BLOCK=TREE_BLOCK, BK=min(dk, step),
            FACTORS=max(1, (ancestors.shape[1] - 1).bit_length()), PRECISION=precision, NORMED=norm is not None,
            PAIRS=blocks_each == 2,
            num_warps=num_warps or TREE_WARPS, num_stages=stages, **launch_options(out.device),
        )
        return out

    form = form or TREE_FORM
    if form is None:
        shape = (str(v_.device), tuple(kq.shape), tuple(v_.shape), tuple(slots.shape), apart, precision,
                 norm is not None, model_dtype, num_warps)
        form = chosen_form(shape, launch, v_.device)
    return launch(form)


def chosen_form(shape: tuple, launch, device: torch.device) -> tuple[int, int, int]:
    """The tree kernel's (step, stages, blocks a program) for a pass of this shape (``TREE_FORM`` None),
    chosen at its first call and kept for the process. First met inside ``lt_product.choosing()`` (the
    graphs' warm-ups), each of FORM_CHOICES runs on this call's own inputs (``launch(form)``); a form that
    fails or whose output is not the first one's bit for bit is refused with a warning, and another replaces
    the first only where ``lt_product.time_calls`` puts it FORM_MARGIN under the first's time. First met
    anywhere else: the first choice, untimed (a prompt's every last partial chunk would be timed inside
    timed runs)."""
    from workers.models import lt_product

    if shape not in _FORMS:
        default = FORM_CHOICES[0]
        _FORMS[shape] = default
        if lt_product.choosing_now():
            first = launch(default)
            agreeing = [default]
            for form in FORM_CHOICES[1:]:
                try:
                    out = launch(form)
                except Exception as exc:  # e.g. past this GPU's shared memory: the first form stays
                    warnings.warn(f"gdn_triton: the tree kernel failed in form {form_name(form)} on its trial "
                                  f"({exc!r}); not taken")
                    continue
                if torch.equal(out, first):
                    agreeing.append(form)
                else:
                    warnings.warn(f"gdn_triton: the tree kernel in form {form_name(form)} gives other bits than in "
                                  f"{form_name(default)}; not taken")
            times = lt_product.time_calls([lambda form=form: launch(form) for form in agreeing], device)
            best = min(range(len(agreeing)), key=times.__getitem__)
            if times[best] < (1 - FORM_MARGIN) * times[0]:
                _FORMS[shape] = agreeing[best]
            per_call = 1e3 / lt_product.TIMED_CALLS
            _FORM_TRIALS[shape] = ", ".join(f"{form_name(form)} {ms * per_call:.1f} us"
                                            for form, ms in zip(agreeing, times, strict=True))
    return _FORMS[shape]


def form_name(form: tuple[int, int, int]) -> str:
    return f"step {form[0]}, {form[1]} stages, {form[2]} block{'s' * (form[2] > 1)} a program"


def forms_report() -> list[str]:
    """A line per tree-pass shape whose form was chosen on trial: what the trial found, the form kept."""
    return [f"{shape[0]} GDN tree kernel, {shape[1][2]} nodes, {shape[2][0]} heads: {found} -> "
            f"{form_name(_FORMS[shape])}" for shape, found in _FORM_TRIALS.items()]


class PrologueOutputs(NamedTuple):
    """What ``prologue`` writes (beta and log_gate None unless the gates were asked for)."""

    kq: torch.Tensor  # [Hk, 2, q, D] float32: k_ at [:, 0], q_ (scaled by D^-1/2) at [:, 1], per key head
    v: torch.Tensor  # [H, q, D] float32
    beta: torch.Tensor | None  # [q, H] in b's dtype
    log_gate: torch.Tensor | None  # [q, H] float32


@triton.jit
def _prologue_kernel(
    WIN, INP, EXT, LAG, W, BIAS, KQ, V, B, A, A_LOG, DT_BIAS, BETA, LOG_GATE,
    nodes, channels, inp_stride, b_stride, a_stride,
    KEY_HEADS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, TAPS: tl.constexpr, NODES: tl.constexpr,
    WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, HAS_EXT: tl.constexpr, HAS_GATES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (NODES nodes t, head segment s): the conv over each node's ancestry + SiLU of one head's
    channels, then (q, k heads) the l2 norm, stored once per key head; (v heads) the gates of value
    head s - 2 Hk. Rows of the extended input below TAPS - 1 are the window's, the rest the node
    inputs' (WINDOW = TAPS - 1)."""
    wait_for_inputs(PDL)
    block = tl.program_id(0)
    s = tl.program_id(1)
    t = block * NODES + tl.arange(0, NODES)  # [NODES]
    real = t < nodes
    d = tl.arange(0, D)
    c = s * D + d  # q heads, then k heads, then v heads: the conv channels in order
    acc = tl.zeros((NODES, D), dtype=tl.float32)
    for lag in tl.static_range(TAPS):  # tap `lag` reads the input `lag` steps back with weight[:, K-1-lag]
        row = tl.load(LAG + t * TAPS + lag, mask=real, other=0)  # [NODES]
        in_window = row < WINDOW
        x = tl.where(in_window[:, None],
                     tl.load(WIN + row[:, None] * channels + c[None, :], mask=(real & in_window)[:, None], other=0.0),
                     tl.load(INP + (row - WINDOW)[:, None] * inp_stride + c[None, :],
                             mask=(real & (row >= WINDOW))[:, None], other=0.0))
        if HAS_EXT:
            if lag == 0:  # row window + t: the node's own input
                tl.store(EXT + row[:, None] * channels + c[None, :], x, mask=real[:, None])
        acc += x.to(tl.float32) * tl.load(W + c * TAPS + (TAPS - 1 - lag)).to(tl.float32)[None, :]
    if HAS_EXT:
        if block == 0:  # the committed window heads the extended rows
            for i in tl.static_range(WINDOW):
                tl.store(EXT + i * channels + c, tl.load(WIN + i * channels + c))
    if HAS_BIAS:
        acc += tl.load(BIAS + c).to(tl.float32)[None, :]
    x = acc * tl.sigmoid(acc)
    x = x.to(WIN.dtype.element_ty).to(tl.float32)  # the torch path rounds the conv output to the model dtype
    if s < 2 * KEY_HEADS:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1, keep_dims=True) + 1e-6)
        is_query = s < KEY_HEADS
        part = tl.where(is_query, 1, 0)  # KQ's k_ rows at 0, q_ rows at 1
        hk = tl.where(is_query, s, s - KEY_HEADS)
        x = tl.where(is_query, x * SCALE, x)
        tl.store(KQ + ((hk * 2 + part) * nodes + t[:, None]) * D + d[None, :], x, mask=real[:, None])
    else:
        h = s - 2 * KEY_HEADS
        tl.store(V + (h * nodes + t[:, None]) * D + d[None, :], x, mask=real[:, None])
        if HAS_GATES:
            b = tl.load(B + t * b_stride + h, mask=real, other=0.0).to(tl.float32)
            tl.store(BETA + t * HEADS + h, tl.sigmoid(b).to(BETA.dtype.element_ty), mask=real)
            # softplus as torch's (threshold 20), log1p(e) = log(u) e / (u - 1) with u = 1 + e
            z = tl.load(A + t * a_stride + h, mask=real, other=0.0).to(tl.float32) + tl.load(DT_BIAS + h).to(tl.float32)
            e = tl.exp(z)
            u = 1.0 + e
            softplus = tl.where(z > 20.0, z, tl.where(u == 1.0, e, tl.log(u) * e / (u - 1.0)))
            tl.store(LOG_GATE + t * HEADS + h, -tl.exp(tl.load(A_LOG + h).to(tl.float32)) * softplus, mask=real)


def prologue(
    window: torch.Tensor,  # [K-1, C] committed conv inputs, oldest first (the model dtype)
    inputs: torch.Tensor,  # [q, C] the nodes' conv inputs (rows may be strided)
    lag_index: torch.Tensor,  # [q, K] rows of cat(window, inputs), from ``gdn.conv_lag_index``
    weight: torch.Tensor,  # [C, K] depthwise kernel
    bias: torch.Tensor | None,
    key_heads: int,
    heads: int,
    head_dim: int,
    extended: torch.Tensor | None = None,  # [K-1+q, C]: if given, receives cat(window, inputs)
    gates: tuple[torch.Tensor, ...] | None = None,  # (b [q, H], a [q, H], A_log [H], dt_bias [H]); rows may be strided
) -> PrologueOutputs:
    """q_, k_, v as ``gdn.tree_conv`` + l2 normalisation compute them (dk = dv = D), and the gates."""
    nodes, taps = lag_index.shape
    channels = inputs.shape[1]
    device = inputs.device
    kq = torch.empty(key_heads, 2, nodes, head_dim, dtype=torch.float32, device=device)
    v = torch.empty(heads, nodes, head_dim, dtype=torch.float32, device=device)
    beta = log_gate = None
    b = a = a_log = dt_bias = weight  # placeholders the kernel does not read without gates
    if gates is not None:
        b, a, a_log, dt_bias = (x if x.stride(-1) == 1 else x.contiguous() for x in gates)
        beta = torch.empty(nodes, heads, dtype=b.dtype, device=device)
        log_gate = torch.empty(nodes, heads, dtype=torch.float32, device=device)
    _prologue_kernel[(triton.cdiv(nodes, PROLOGUE_NODES), 2 * key_heads + heads)](
        window, inputs, extended if extended is not None else window, lag_index, weight.contiguous(),
        bias if bias is not None else weight, kq, v, b, a, a_log, dt_bias,
        beta if beta is not None else v, log_gate if log_gate is not None else v,
        nodes, channels, inputs.stride(0), b.stride(0), a.stride(0),
        KEY_HEADS=key_heads, HEADS=heads, D=head_dim, TAPS=taps, NODES=PROLOGUE_NODES, WINDOW=taps - 1,
        HAS_BIAS=bias is not None, SCALE=head_dim**-0.5, HAS_EXT=extended is not None, HAS_GATES=gates is not None,
        num_warps=PROLOGUE_WARPS, **launch_options(kq.device),
    )
    return PrologueOutputs(kq, v, beta, log_gate)


@triton.jit
def _gated_norm(x, z, weight, eps, dtype: tl.constexpr, D: tl.constexpr):
    """Qwen3.5's RMSNormGated of rows x [R, D] (float32) with gates z [R, D], with its roundings to
    ``dtype``: the norm's output, the weight's product, the gated result."""
    x = x.to(dtype).to(tl.float32)
    y = (x * tl.rsqrt(tl.sum(x * x, axis=1, keep_dims=True) / D + eps)).to(dtype)
    y = (weight.to(dtype) * y).to(tl.float32)
    z = z.to(tl.float32)
    return (y * z * tl.sigmoid(z)).to(dtype)


@triton.jit
def _gated_norm_kernel(O, Z, W, OUT, heads, z_stride, eps, D: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
    """Program (node t, block of BH heads): ``_gated_norm`` of those heads' output rows."""
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)[:, None]  # [BH, 1]
    d = tl.arange(0, D)[None, :]
    inside = h < heads
    x = tl.load(O + (t * heads + h) * D + d, mask=inside, other=0.0)
    z = tl.load(Z + t * z_stride + h * D + d, mask=inside, other=0.0)
    tl.store(OUT + (t * heads + h) * D + d, _gated_norm(x, z, tl.load(W + d), eps, OUT.dtype.element_ty, D),
             mask=inside)


def gated_norm(out: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
               dtype: torch.dtype) -> torch.Tensor:
    """out [q, H, D] float32, z [q, H*D] (rows may be strided) -> [q, H*D] in ``dtype``."""
    out = out.contiguous()
    nodes, heads, head_dim = out.shape
    result = torch.empty(nodes, heads * head_dim, dtype=dtype, device=out.device)
    block = min(NORM_HEADS, triton.next_power_of_2(heads))
    _gated_norm_kernel[(nodes, triton.cdiv(heads, block))](out, z, weight, result, heads, z.stride(0), eps,
                                                            D=head_dim, BH=block, num_warps=4,
                                                            **launch_options(out.device))
    return result


@triton.jit
def _chain_state_kernel(K, Q, V, G, BETA, S, OUT, k_stride, count: tl.constexpr, HEADS: tl.constexpr,
                        REPEAT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                        PDL: tl.constexpr):
    """Program (value head h, block of value columns): the recurrent delta rule over ``count`` tokens with
    the state block [DK, BV] in registers, read once and written back in place, and each token's output
    q_t S_t. (``count`` is a compile-time constant, one variant per length.)"""
    wait_for_inputs(PDL)
    h = tl.program_id(0)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    d = tl.arange(0, DK)
    hk = h // REPEAT
    block = S + h * DK * DV + d[:, None] * DV + cols[None, :]
    state = tl.load(block)
    for t in range(count):
        key = tl.load(K + hk * k_stride + t * DK + d)
        value = tl.load(V + (h * count + t) * DV + cols)
        state = state * tl.exp(tl.load(G + t * HEADS + h))
        delta = tl.load(BETA + t * HEADS + h).to(tl.float32) * (value - tl.sum(state * key[:, None], axis=0))
        state += key[:, None] * delta[None, :]
        query = tl.load(Q + hk * k_stride + t * DK + d)
        tl.store(OUT + (t * HEADS + h) * DV + cols, tl.sum(state * query[:, None], axis=0))
    tl.store(block, state)


def advance_state(k_: torch.Tensor, q_: torch.Tensor, v_: torch.Tensor, log_gate: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> torch.Tensor:
    """A few tokens kept whole (AR's one): state [H, dk, dv] float32 advanced in place over them as the
    sequential kernel does, and their outputs [c, H, dv] float32. k_ / q_ [Hk, c, dk] (normalised, q_
    scaled; or one per value head, [H, c, dk]; same layout, rows contiguous), v_ [H, c, dv],
    log_gate / beta [c, H]."""
    key_heads, count, dk = k_.shape
    heads, _, dv = v_.shape
    block = min(dv, 32)
    if k_.stride(2) != 1 or k_.stride(1) != dk or q_.stride() != k_.stride():
        k_, q_ = k_.contiguous(), q_.contiguous()
    out = torch.empty(count, heads, dv, dtype=torch.float32, device=v_.device)
    _chain_state_kernel[(heads, dv // block)](
        k_, q_, v_.contiguous(), log_gate.float().contiguous(), beta.contiguous(), state, out, k_.stride(0), count,
        HEADS=heads, REPEAT=heads // key_heads, DK=dk, DV=dv, BV=block, num_warps=4, **launch_options(out.device),
    )
    return out


@triton.jit
def _commit_kernel(EXT, PATH, W, BIAS, G, BETA, S, WIN, channels, count: tl.constexpr,
                   KEY_HEADS: tl.constexpr, HEADS: tl.constexpr, REPEAT: tl.constexpr, D: tl.constexpr,
                   BV: tl.constexpr, TAPS: tl.constexpr, WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr,
                   PDL: tl.constexpr):
    """Program (value head h, block of value columns): a commit of the path PATH[:count] (root ... node)
    for one layer. Per path token: the conv over the path (then the committed window) of its key head's
    and value columns' channels, SiLU, the key's l2 norm (the prologue's arithmetic), then the delta rule
    with the state block in registers; finally this program's channels of the new conv window.
    EXT [WINDOW + q, channels]: the pass's window then node inputs; G / BETA [q, H] per node."""
    wait_for_inputs(PDL)
    h = tl.program_id(0)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    d = tl.arange(0, D)
    hk = h // REPEAT
    key_channels = KEY_HEADS * D + hk * D + d  # q heads, then k heads, then v heads
    value_channels = 2 * KEY_HEADS * D + h * D + cols
    block = S + h * D * D + d[:, None] * D + cols[None, :]
    state = tl.load(block)
    for t in range(count):
        k_acc = tl.zeros((D,), dtype=tl.float32)
        v_acc = tl.zeros((BV,), dtype=tl.float32)
        for lag in tl.static_range(TAPS):  # the path's own inputs back to the root, then the window's
            j = t - lag
            node = tl.load(PATH + tl.maximum(j, 0))
            row = tl.where(j >= 0, WINDOW + node, WINDOW + j)
            k_acc += tl.load(EXT + row * channels + key_channels).to(tl.float32) * \
                tl.load(W + key_channels * TAPS + (TAPS - 1 - lag)).to(tl.float32)
            v_acc += tl.load(EXT + row * channels + value_channels).to(tl.float32) * \
                tl.load(W + value_channels * TAPS + (TAPS - 1 - lag)).to(tl.float32)
        if HAS_BIAS:
            k_acc += tl.load(BIAS + key_channels).to(tl.float32)
            v_acc += tl.load(BIAS + value_channels).to(tl.float32)
        key = (k_acc * tl.sigmoid(k_acc)).to(EXT.dtype.element_ty).to(tl.float32)
        key = key * tl.rsqrt(tl.sum(key * key, axis=0) + 1e-6)
        value = (v_acc * tl.sigmoid(v_acc)).to(EXT.dtype.element_ty).to(tl.float32)
        node = tl.load(PATH + t)
        state = state * tl.exp(tl.load(G + node * HEADS + h))
        delta = tl.load(BETA + node * HEADS + h).to(tl.float32) * (value - tl.sum(state * key[:, None], axis=0))
        state += key[:, None] * delta[None, :]
    tl.store(block, state)
    _store_window(EXT, PATH, WIN, channels, count, h, hk, cols, value_channels, KEY_HEADS, REPEAT, D, WINDOW)


@triton.jit
def _store_window(EXT, PATH, WIN, channels, count, h, hk, cols, value_channels, KEY_HEADS: tl.constexpr,
                  REPEAT: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr):
    """A commit's new conv window: the last WINDOW rows of cat(window, path inputs). Program (h, cols)
    writes its value columns, and the first value head of each key head that key head's q and k columns."""
    for i in tl.static_range(WINDOW):
        past = count + i - WINDOW  # >= 0: the path's node at that index; else the old window's row count + i
        row = tl.where(past < 0, count + i, WINDOW + tl.load(PATH + tl.maximum(past, 0)))
        tl.store(WIN + i * channels + value_channels, tl.load(EXT + row * channels + value_channels))
        if h % REPEAT == 0:
            for part in tl.static_range(2):
                qk_channels = part * KEY_HEADS * D + hk * D + cols
                tl.store(WIN + i * channels + qk_channels, tl.load(EXT + row * channels + qk_channels))


@triton.jit
def _path_conv(EXT, W, BIAS, PATH, channels, chans, t, on, TAPS: tl.constexpr, WINDOW: tl.constexpr,
               HAS_BIAS: tl.constexpr):
    """The conv over a path, then SiLU, of the channels ``chans`` [C] for the path's tokens ``t`` [N]
    (where ``on``): [N, C] float32, rounded to EXT's dtype as the prologue rounds them. A token's taps
    are the path's own inputs back to the root, then the committed window's rows."""
    acc = tl.zeros((t.shape[0], chans.shape[0]), dtype=tl.float32)
    for lag in tl.static_range(TAPS):
        j = t - lag
        node = tl.load(PATH + tl.maximum(j, 0), mask=on, other=0).to(tl.int32)
        row = tl.where(j >= 0, WINDOW + node, WINDOW + j)
        tap = tl.load(W + chans * TAPS + (TAPS - 1 - lag)).to(tl.float32)
        acc += tl.load(EXT + row[:, None] * channels + chans[None, :], mask=on[:, None], other=0.0).to(tl.float32) \
            * tap[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + chans).to(tl.float32)[None, :]
    return tl.where(on[:, None], (acc * tl.sigmoid(acc)).to(EXT.dtype.element_ty).to(tl.float32), 0.0)


@triton.jit(do_not_specialize=["count"])
def _commit_chunk_kernel(EXT, PATH, W, BIAS, G, BETA, S, WIN, channels, count, KEY_HEADS: tl.constexpr,
                         HEADS: tl.constexpr, REPEAT: tl.constexpr, D: tl.constexpr, BV: tl.constexpr,
                         BK: tl.constexpr, N: tl.constexpr, FACTORS: tl.constexpr, TAPS: tl.constexpr,
                         WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """``_commit_kernel``'s commit in the tree kernel's regrouped form: the whole path at once, not token
    by token, so its time hardly grows with the path's length (``count`` <= N, a runtime value: one
    compile serves every length). With K [N, D] the path's normalised keys, its deltas x [N, BV] solve
    (I + L) x = r, L[t, m] = beta_t exp(G_t - G_m) k_t.k_m (m < t), r_t = beta_t (v_t - exp(G_t) k_t S0),
    by the nilpotent product as in ``_block_outputs``; then S = exp(G_n) S0 + (exp(G_n - G) K)^T x. Along
    D in steps of BK (whole [N, D] key tiles spill registers), unrolled so that the steps' loads are in
    flight together: the keys' Gram matrix and K S0 from the raw keys, scaled by their norms after; the
    update recomputes each step's keys. Rows past ``count`` load nothing and have beta = 0."""
    wait_for_inputs(PDL)
    h = tl.program_id(0)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    t = tl.arange(0, N)
    on = t < count
    hk = h // REPEAT
    key_channels = KEY_HEADS * D + hk * D  # q heads, then k heads, then v heads
    value_channels = 2 * KEY_HEADS * D + h * D + cols
    state_block = S + h * D * D + cols[None, :]
    squares = tl.zeros((N,), dtype=tl.float32)
    gram = tl.zeros((N, N), dtype=tl.float32)
    keys_state = tl.zeros((N, BV), dtype=tl.float32)  # K S0 (raw keys)
    for step in tl.static_range(0, D, BK):
        ds = step + tl.arange(0, BK)
        keys = _path_conv(EXT, W, BIAS, PATH, channels, key_channels + ds, t, on, TAPS, WINDOW, HAS_BIAS)
        squares += tl.sum(keys * keys, axis=1)
        gram = tl.dot(keys, tl.trans(keys), gram, input_precision=PRECISION)
        keys_state = tl.dot(keys, tl.load(state_block + ds[:, None] * D), keys_state, input_precision=PRECISION)
    norm = tl.rsqrt(squares + 1e-6)  # the keys' l2 norms, as the prologue takes them
    gram = gram * norm[:, None] * norm[None, :]
    values = _path_conv(EXT, W, BIAS, PATH, channels, value_channels, t, on, TAPS, WINDOW, HAS_BIAS)
    node = tl.load(PATH + t, mask=on, other=0)
    g = tl.load(G + node * HEADS + h, mask=on, other=0.0)
    beta = tl.load(BETA + node * HEADS + h, mask=on, other=0.0).to(tl.float32)
    G_path = tl.sum(tl.where(t[None, :] <= t[:, None], g[None, :], 0.0), axis=1)  # [N] the path sums of g
    G_end = tl.sum(g, axis=0)
    earlier = t[None, :] < t[:, None]  # [N, N]: m before t
    L = tl.where(earlier, beta[:, None] * tl.exp(tl.where(earlier, G_path[:, None] - G_path[None, :], 0.0)) * gram,
                 0.0)
    x = beta[:, None] * (values - (tl.exp(G_path) * norm)[:, None] * keys_state)
    x = x - tl.dot(L, x, input_precision=PRECISION)  # (I + L)^-1 r = (I + L^8)(I + L^4)(I + L^2)(I - L) r
    power = L
    for _ in tl.static_range(FACTORS - 1):
        power = tl.dot(power, power, input_precision=PRECISION)
        x = x + tl.dot(power, x, input_precision=PRECISION)
    weight = norm * tl.exp(G_end - G_path)  # [N] on the raw keys
    for step in tl.static_range(0, D, BK):
        ds = step + tl.arange(0, BK)
        keys = _path_conv(EXT, W, BIAS, PATH, channels, key_channels + ds, t, on, TAPS, WINDOW, HAS_BIAS)
        block = state_block + ds[:, None] * D
        tl.store(block, tl.dot(tl.trans(keys * weight[:, None]), x, tl.load(block) * tl.exp(G_end),
                               input_precision=PRECISION))
    _store_window(EXT, PATH, WIN, channels, count, h, hk, cols, value_channels, KEY_HEADS, REPEAT, D, WINDOW)


def commit_path(extended: torch.Tensor, path: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                log_gate: torch.Tensor, beta: torch.Tensor, state: torch.Tensor, window: torch.Tensor,
                key_heads: int, form: str | None = None) -> None:
    """One GDN layer's commit in one kernel: (window, state) advanced in place over the nodes ``path``
    [c] (root ... accepted node) of the pass that kept ``extended`` [K-1+q, C] (its window, then its
    node inputs), ``log_gate`` / ``beta`` [q, H]; ``weight`` [C, K] the depthwise conv, dk = dv.
    ``form`` (default ``COMMIT_FORM``): "replay", token by token; "chunk", the regrouped form."""
    heads, dk, dv = state.shape
    count, taps = path.shape[0], weight.shape[1]
    block = min(dv, 32)
    form = form or COMMIT_FORM
    if form == "chunk":
        rows = triton.next_power_of_2(max(count, 16))  # tl.dot's least side is 16
        _commit_chunk_kernel[(heads, dv // block)](
            extended, path, weight.contiguous(), bias if bias is not None else weight, log_gate, beta, state,
            window, extended.shape[1], count,
            KEY_HEADS=key_heads, HEADS=heads, REPEAT=heads // key_heads, D=dk, BV=block, BK=min(dk, 32), N=rows,
            FACTORS=max(1, (rows - 1).bit_length()), TAPS=taps, WINDOW=taps - 1, HAS_BIAS=bias is not None,
            PRECISION=COMMIT_PRECISION, num_warps=COMMIT_CHUNK_WARPS, **launch_options(state.device),
        )
        return
    if form != "replay":
        raise ValueError(f"commit form {form!r}: expected 'replay' or 'chunk'")
    _commit_kernel[(heads, dv // block)](
        extended, path, weight.contiguous(), bias if bias is not None else weight, log_gate, beta, state, window,
        extended.shape[1], count,
        KEY_HEADS=key_heads, HEADS=heads, REPEAT=heads // key_heads, D=dk, BV=block, TAPS=taps, WINDOW=taps - 1,
        HAS_BIAS=bias is not None, num_warps=4, **launch_options(state.device),
    )


_COMPILED_COMMITS: set[tuple] = set()  # (key heads, heads, head dim, taps, dtype, bias, device, form) compiled


def compile_commit_lengths(key_heads: int, heads: int, head_dim: int, taps: int, dtype: torch.dtype,
                           has_bias: bool, device: torch.device, longest: int = 16) -> None:
    """Compile ``commit_path``'s kernel for every path length 1..``longest`` (and ``advance_state``'s for AR's
    one token) once per process and commit form. The replay form's length is a compile-time constant, so
    the first commit of each new accepted length would otherwise compile a variant (about half a second)
    inside a timed round (the chunk form compiles once). Runs the kernels on zeros of the real layouts."""
    key = (key_heads, heads, head_dim, taps, dtype, has_bias, str(device), COMMIT_FORM)
    if key in _COMPILED_COMMITS:
        return
    channels = (2 * key_heads + heads) * head_dim
    weight = torch.zeros(channels, taps, dtype=dtype, device=device)
    bias = torch.zeros(channels, dtype=dtype, device=device) if has_bias else None
    state = torch.zeros(heads, head_dim, head_dim, dtype=torch.float32, device=device)
    window = torch.zeros(taps - 1, channels, dtype=dtype, device=device)
    for count in range(1, longest + 1):
        extended = torch.zeros(taps - 1 + count, channels, dtype=dtype, device=device)
        gates = torch.zeros(count, heads, dtype=torch.float32, device=device)
        beta = torch.zeros(count, heads, dtype=dtype, device=device)
        commit_path(extended, torch.arange(count, device=device), weight, bias, gates, beta, state, window, key_heads)
    kq = torch.zeros(key_heads, 2, 1, head_dim, dtype=torch.float32, device=device)  # as the prologue writes it
    advance_state(kq[:, 0], kq[:, 1], torch.zeros(heads, 1, head_dim, device=device),
                  torch.zeros(1, heads, device=device), torch.zeros(1, heads, dtype=dtype, device=device), state)
    _COMPILED_COMMITS.add(key)
