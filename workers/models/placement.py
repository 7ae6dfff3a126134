"""Splitting one actor's target over its GPUs, planned before loading, with headroom for the run.

A target too big for one GPU (Qwen3.6-27B: ~50 GiB of bf16 weights on 2 x 48 GB) is split layer by
layer with accelerate's ``infer_auto_device_map`` on a meta-device copy of the model. What each GPU
must also hold is reserved first, so the plan cannot fill a GPU with weights and fail on the
first long prompt:

- every GPU: the CUDA context and kernel workspaces (``FIXED_BYTES``), plus the per-sequence state of
  the layers it holds (attention K/V for ``max_tokens``; GDN state and, for the largest
  tree, the per-node data of ``workers.models.gdn.tree_state_bytes``), spread evenly for the split;
- the GPU with the last layers and ``lm_head``: the DFlash drafter (it reads the target's
  ``lm_head`` and last taps there) and the verify pass's logits and activations;
- the CUDA graphs' private memory pools (``RunBudget.graph_widths`` verify widths kept captured,
  each sized for ``max_verify``): every pool holds its own copy of the pass's outputs (the logits
  on the ``lm_head`` GPU, each GDN layer's pending data with that layer) and the pass's activations
  at their peak on every GPU it spans (``graph_activation_bytes``); the prompt chunk's captured
  pass adds one more pool of activations.

Weights are then balanced so every GPU keeps a similar amount free, and the finished map is
checked module by module against each GPU's size; a plan that does not fit is refused with the
numbers, before anything is loaded.

A tensor-parallel target (``plan_tensor_parallel``) is instead cut into N equal shards, one per GPU:
each rank holds 1/N of every layer's sharded weights plus the replicated ones (norms, embedding,
routers), the state of its own heads, the full gathered logits, and a whole drafter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from workers.errors import BadInputError
from workers.models.runner.limits import MAX_VERIFY_GRAPHS
from workers.seam import attention_head_dim, text_config

FIXED_BYTES = int(1.5 * 2**30)  # CUDA context, cuBLAS / attention workspaces, allocator slack
GiB = 2**30
# a captured graph's pool: allocator segments it rounds up to, and its rows' size over the MLP's (see
# ``graph_activation_bytes``; both fitted to benchmarks/graph_pools.py's measurements)
GRAPH_POOL_SLACK = 96 * 2**20
GRAPH_ROW_FACTOR = 4
MULTIPROCESSORS = 160  # at least any GPU's count (an H200 has 132, an RTX A6000 84): bounds split-key partials


@dataclass(frozen=True)
class RunBudget:
    """The largest run the reserve is sized for."""

    max_tokens: int = 16384  # prompt + generated + one verify pass
    max_verify: int = 1025  # nodes in one verify pass (tree budget + 1)
    graph_widths: int = MAX_VERIFY_GRAPHS  # verify graphs a target keeps captured; 0 = eager

    @property
    def activation_pools(self) -> int:
        """Captured passes whose pools hold a pass's activations: each kept verify width, plus the prompt
        chunk's pass (``StaticTarget.advance``; sized as a widest verify pass's, not measured on its own).
        AR's one-token pass fits in FIXED_BYTES (its pool at width 1: ``benchmarks/graph_pools.py``, run in
        ``benchmarks/results/hybrid_speed_h200.md``)."""
        return self.graph_widths + 1 if self.graph_widths else 0


@dataclass(frozen=True)
class PlacementPlan:
    device_map: dict[str, int]  # module name -> GPU index
    gpu_bytes: tuple[int, ...]
    weight_bytes: tuple[int, ...]  # per GPU
    reserve_bytes: tuple[int, ...]  # per GPU: fixed + layer state + (last GPU) drafter, logits, activations
    drafter_gpu: int

    def free_bytes(self) -> tuple[int, ...]:
        return tuple(g - w - r for g, w, r in zip(self.gpu_bytes, self.weight_bytes, self.reserve_bytes))

    def describe(self) -> str:
        rows = [f"{'gpu':>4} {'size':>9} {'weights':>9} {'reserve':>9} {'free':>9}  layers"]
        for gpu, size in enumerate(self.gpu_bytes):
            layers = sorted(_layer_index(name) for name, where in self.device_map.items()
                            if where == gpu and _layer_index(name) is not None)
            span = f"{layers[0]}..{layers[-1]}" if layers else "-"
            extra = " + lm_head + drafter" if gpu == self.drafter_gpu else ""
            rows.append(f"{gpu:>4} {size / GiB:>7.1f}Gi {self.weight_bytes[gpu] / GiB:>7.1f}Gi "
                        f"{self.reserve_bytes[gpu] / GiB:>7.1f}Gi {self.free_bytes()[gpu] / GiB:>7.1f}Gi  "
                        f"{span}{extra}")
        return "\n".join(rows)


def layer_state_bytes(config, layer_type: str, budget: RunBudget, dtype: torch.dtype) -> int:
    """Per-sequence memory one decoder layer needs beside its weights."""
    cfg = text_config(config)
    element = torch.empty((), dtype=dtype).element_size()
    if layer_type == "linear_attention":
        from workers.models.gdn import tree_state_bytes

        layers = sum(kind == "linear_attention" for kind in cfg.layer_types)
        conv_dim = (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
                    + cfg.linear_num_value_heads * cfg.linear_value_head_dim)
        state = 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        pending = tree_state_bytes(cfg, budget.max_verify, dtype) // layers  # one pass's, and each graph's own
        return state + element * conv_dim * cfg.linear_conv_kernel_dim + (1 + budget.graph_widths) * pending
    return 2 * cfg.num_key_value_heads * attention_head_dim(cfg) * budget.max_tokens * element


def head_bytes(config, budget: RunBudget, dtype: torch.dtype) -> int:
    """The verify pass's logits (model dtype, then float32 for sampling) and widest activations."""
    cfg = text_config(config)
    element = torch.empty((), dtype=dtype).element_size()
    logits = budget.max_verify * cfg.vocab_size * (element + 4)
    activations = budget.max_verify * (3 * cfg.intermediate_size + 6 * cfg.hidden_size) * element
    graph_logits = budget.graph_widths * budget.max_verify * cfg.vocab_size * element  # each graph's own output
    return logits + activations + graph_logits


def graph_activation_bytes(config, budget: RunBudget, dtype: torch.dtype) -> int:
    """One verify graph's pool beyond its outputs, on each GPU the pass spans: the pass's transient
    activations at their peak (a captured pass reuses its own freed blocks) plus the allocator's
    segment rounding. Sized from the widest rows (the MLP's gate/up and activation, hidden-size
    temporaries; float32 GDN and attention intermediates make the rows ``benchmarks/graph_pools.py``
    measures several times that), a few-row attention's scores over the whole K/V buffer, and many rows'
    partial sums when the Triton attention splits the keys."""
    cfg = text_config(config)
    element = torch.empty((), dtype=dtype).element_size()
    row = GRAPH_ROW_FACTOR * (3 * cfg.intermediate_size + 6 * cfg.hidden_size)
    # few rows attend by batched products where the Triton kernel is not taken (``attention.attend_folded``):
    # scores and softmax [Hkv, rows, C]; where it is, the kernel's split keys' partial sums, float32
    # (merged by one kernel, which makes no copy). The larger of the two that can happen.
    from workers.models.attention import SMALL_ATTENTION_ROWS
    from workers.models.kernels import MAX_KEY_SPLITS, ROW_BLOCK

    rows = cfg.num_attention_heads // cfg.num_key_value_heads * budget.max_verify
    scores = 2 * cfg.num_key_value_heads * rows * budget.max_tokens * element if rows <= SMALL_ATTENTION_ROWS else 0
    partial_rows = min(MAX_KEY_SPLITS * cfg.num_key_value_heads * rows, 4 * MULTIPROCESSORS * ROW_BLOCK)
    partials = partial_rows * attention_head_dim(cfg) * 4
    return GRAPH_POOL_SLACK + budget.max_verify * row * element + max(scores, partials)


def plan_split(
    config,
    gpu_bytes: list[int],
    dtype: torch.dtype = torch.bfloat16,
    drafter_bytes: int = 0,
    budget: RunBudget = RunBudget(),
    weight_cap: int | None = None,
) -> PlacementPlan:
    """A device_map over ``len(gpu_bytes)`` GPUs for a model of ``config``, or BadInputError."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import compute_module_sizes
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    sizes = compute_module_sizes(model, dtype=dtype)
    cfg = text_config(config)
    layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
    state = [layer_state_bytes(config, kind, budget, dtype) for kind in layer_types]
    count, last = len(gpu_bytes), len(gpu_bytes) - 1
    last_extra = drafter_bytes + head_bytes(config, budget, dtype)

    # usable bytes for weights per GPU: size minus fixed, an even share of layer state, and (last) the head
    fixed = FIXED_BYTES + budget.activation_pools * graph_activation_bytes(config, budget, dtype)  # on every GPU
    usable = [size - fixed - sum(state) // count - (last_extra if gpu == last else 0)
              for gpu, size in enumerate(gpu_bytes)]
    if weight_cap is not None:
        usable = [min(u, weight_cap) for u in usable]
    weights = sizes[""]
    if sum(max(u, 0) for u in usable) < weights:
        raise BadInputError(_shortfall(weights, usable, gpu_bytes, drafter_bytes))
    # balance: every GPU gives up an equal share of the slack (the last one keeps any rounding)
    slack = (sum(usable) - weights) // count
    largest_layer = max(sizes[f"model.layers.{i}"] for i in range(len(layer_types)))
    max_memory = {gpu: max(u - slack + (largest_layer if gpu < last else 0), 0) for gpu, u in enumerate(usable)}
    max_memory[last] = usable[last]
    logging.getLogger("accelerate.utils.modeling").setLevel(logging.ERROR)  # "device N is not available" on CPU
    device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=model._no_split_modules,
                                       dtype=dtype)
    off_gpu = sorted(name for name, where in device_map.items() if not isinstance(where, int))
    if off_gpu:  # whole layers do not pack into what is left (accelerate also keeps a layer's room free)
        room = " + ".join(f"{max_memory[gpu] / GiB:.1f}" for gpu in range(count))
        raise BadInputError(f"the target's {weights / GiB:.1f} GiB of weights do not pack into {room} GiB of GPU room "
                            f"left after the runtime reserve: {', '.join(off_gpu[:3])} would go to "
                            f"{device_map[off_gpu[0]]}; raise max_memory_per_gpu or use more GPUs")
    return _checked_plan(device_map, sizes, state, gpu_bytes, last_extra, drafter_bytes, fixed)


def _checked_plan(device_map, sizes, state, gpu_bytes, last_extra, drafter_bytes, fixed: int) -> PlacementPlan:
    lm_gpu = device_map.get("lm_head", max(device_map.values()))
    weight_bytes, reserve_bytes = [0] * len(gpu_bytes), [fixed] * len(gpu_bytes)
    for name, gpu in device_map.items():
        weight_bytes[gpu] += sizes[name]
        for i in _layers_in(name, len(state)):
            reserve_bytes[gpu] += state[i]
    reserve_bytes[lm_gpu] += last_extra
    plan = PlacementPlan(device_map, tuple(gpu_bytes), tuple(weight_bytes), tuple(reserve_bytes), lm_gpu)
    short = [gpu for gpu, free in enumerate(plan.free_bytes()) if free < 0]
    if short:
        raise BadInputError(f"split plan leaves GPU {short[0]} {-plan.free_bytes()[short[0]] / GiB:.1f} GiB short "
                            f"(drafter {drafter_bytes / GiB:.1f} GiB):\n{plan.describe()}")
    return plan


def _shortfall(weights: int, usable: list[int], gpu_bytes: list[int], drafter_bytes: int) -> str:
    sizes = " + ".join(f"{size / GiB:.0f}" for size in gpu_bytes)
    return (f"the target's weights need {weights / GiB:.1f} GiB but {len(gpu_bytes)} GPU(s) of {sizes} GiB leave "
            f"{sum(max(u, 0) for u in usable) / GiB:.1f} GiB after the runtime reserve "
            f"(drafter {drafter_bytes / GiB:.1f} GiB, caches, tree buffers): use more GPUs or a smaller dtype")


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if "layers" in parts:
        index = parts.index("layers") + 1
        if index < len(parts) and parts[index].isdigit():
            return int(parts[index])
    return None


def _layers_in(name: str, num_layers: int) -> range | list[int]:
    """Decoder layer indices a device_map entry covers (a whole ``model`` entry covers all)."""
    index = _layer_index(name)
    if index is not None:
        return [index]
    return range(num_layers) if name in ("", "model", "model.layers") else []


def drafter_bytes_for(spec, dtype: torch.dtype) -> int:
    """Weight bytes of a DFlash (or DFlash2) drafter from its ``DrafterSpec`` (built on the meta device)."""
    from workers.models.drafter2 import drafter_for

    with torch.device("meta"):
        drafter = drafter_for(spec)
    element = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in drafter.parameters()) * element



# -- tensor parallel: one GPU per rank, every rank holding 1/N of each layer ------------------------------
COMMUNICATION_BYTES = 512 * 2**20  # NCCL's channel buffers and its share of the captured graphs' pool


@dataclass(frozen=True)
class TensorParallelPlan:
    """What each rank's GPU holds (all ranks alike: the shards are equal and the rest replicated)."""

    world_size: int
    gpu_bytes: int
    weight_bytes: int  # this rank's shard of the target (sharded parts / N, replicated parts whole)
    state_bytes: int  # K/V of the local K/V heads, GDN state and tree data of the local heads
    head_bytes: int  # the verify pass's gathered logits and activations (and each kept graph's logits)
    graph_bytes: int  # the captured verify graphs' pools beyond their outputs (one per kept width)
    drafter_bytes: int  # the drafter, replicated on every rank

    @property
    def reserve_bytes(self) -> int:
        return FIXED_BYTES + COMMUNICATION_BYTES + self.state_bytes + self.head_bytes + self.graph_bytes

    def free_bytes(self) -> int:
        return self.gpu_bytes - self.weight_bytes - self.drafter_bytes - self.reserve_bytes

    def describe(self) -> str:
        parts = {"weights": self.weight_bytes, "drafter": self.drafter_bytes, "caches+tree": self.state_bytes,
                 "logits+activations": self.head_bytes, "graphs": self.graph_bytes,
                 "runtime": FIXED_BYTES + COMMUNICATION_BYTES, "free": self.free_bytes()}
        return f"per rank of {self.world_size}, GPU {self.gpu_bytes / GiB:.1f} GiB: " + ", ".join(
            f"{name} {size / GiB:.2f} GiB" for name, size in parts.items())


def plan_tensor_parallel(
    config,
    gpu_bytes: int,
    world_size: int,
    dtype: torch.dtype = torch.bfloat16,
    drafter_bytes: int = 0,
    budget: RunBudget = RunBudget(),
) -> TensorParallelPlan:
    """Each rank's memory for a target of ``config`` sharded over ``world_size`` GPUs of ``gpu_bytes``
    each, or BadInputError with the numbers (also when a head count does not divide by ``world_size``).

    The weights are counted by sharding a meta-device copy with the same code the ranks run.
    """
    from transformers import AutoModelForCausalLM

    from workers.models.tensor_parallel import TPGroup, check_divisible, shard_model

    cfg = text_config(config)
    check_divisible(cfg, world_size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    shard_model(model, TPGroup(0, world_size))  # meta tensors: no memory, no collective
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    local = _local_config(cfg, world_size)
    layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
    state = sum(layer_state_bytes(local, kind, budget, dtype) for kind in layer_types)
    graphs = budget.activation_pools * graph_activation_bytes(local, budget, dtype)  # each captured pass's pool
    plan = TensorParallelPlan(world_size, gpu_bytes, weights, state, head_bytes(local, budget, dtype), graphs,
                              drafter_bytes)
    if plan.free_bytes() < 0:
        raise BadInputError(f"tensor_parallel={world_size} leaves each GPU {-plan.free_bytes() / GiB:.1f} GiB short "
                            f"({plan.describe()}); use more GPUs, a smaller dtype or a smaller run budget")
    return plan


def _local_config(cfg, world_size: int):
    """A copy of the text config with one rank's head counts and MLP width (the vocabulary stays whole:
    every rank holds the gathered logits)."""
    import copy

    local = copy.copy(cfg)
    local.head_dim = attention_head_dim(cfg)
    for name in ("num_key_value_heads", "num_attention_heads", "linear_num_key_heads", "linear_num_value_heads",
                 "intermediate_size"):
        if getattr(cfg, name, None):
            setattr(local, name, getattr(cfg, name) // world_size)
    return local
