"""Matrix products of many rows through cuBLASLt, with the algorithm timed fastest for each shape on
this GPU (CUDA only; ``nvmath-python``'s bindings of the cuBLASLt C API, the ``gpu`` extra).

out [M, N] = x [M, K] @ weight [N, K]^T, or out += it in place. torch's ``F.linear`` runs cuBLAS's
heuristic first pick, and at a wide verify's rows the heuristic's list holds faster ones for some
products (``benchmarks/lt_gemm.py``; figures in ``benchmarks/results/wide_passes_h200.md``). Faster
still at some shapes is the heuristic's own kernel with tiles fitted to the rows in clusters its list
does not pair them with (at a verify's 257 rows 64 x 136 or 128 x 88 tiles, x's rows in two or three
blocks padded by 15 or 7, in 1x1 or 1x2 clusters): ``fitted`` makes those. So the first time ``linear``
sees a shape (rows, N, K, summed or not) inside ``choosing()``, it times torch's own call against each
algorithm the heuristic offers, each fitted one and each ``Split`` (torch's call in two along N, the first
part cut to fill whole waves of the SMs), on this call's operands into a scratch output with
the L2 flushed before each call (a pass reads each weight from memory), launched one by one or replayed
from a CUDA graph (``TIMING``), times the fastest few again for longer, and keeps the fastest if it beats
torch's by ``MARGIN``. ``graph_cache.capture`` runs its
warm-up calls inside ``choosing()``, so the passes that replay as graphs (verify widths, full prompt
chunks, the drafter's) are timed there, before any timed run. A shape first met anywhere else keeps
torch's call: a prompt's last partial chunk runs eagerly at the prompt's length, and timing each new
length would land in timed runs (an AR baseline's among them). Either way the choice stays for the
process: a captured graph and an eager pass of one shape run the same algorithm, so the same bits.

In cuBLAS's column-major terms the product is D [N, M] = op(A) B with A the weight read transposed
(K x N, leading dimension K), B x (K x M) and C = D = out (N x M): the "TN" form torch runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

ENABLED = True  # off: every caller runs torch's own product (``benchmarks/gpu_speed.py --no-lt``)
MARGIN = 0.05  # an algorithm replaces torch's call only if this much faster (a margin over the timing noise)
CANDIDATES = 8  # the heuristic's list is asked for this many (cuBLASLt 13.1 offers 8 at most here)
FIT_SIDES = (64, 128, 256)  # a fitted tile's side along the weight's rows (N)
FIT_WIDTHS = 8  # the fitted tiles' sides along x's rows: this many, those that pad the rows least, of
# those at least min(rows, 64) wide (narrower ones make many blocks of few rows: slower on every product timed)
FIT_CLUSTERS = ("1x1x1", "1x2x1")  # cluster shapes tried for each fitted tile (N x rows)
WORKSPACE_BYTES = 32 << 20  # the most an offered algorithm may use (one buffer per device, shared, made
# when the first algorithm that uses one is timed: outside any capture, and never moved after)
ALIGNMENT = 256  # bytes: cuBLASLt's heuristic assumes operands this aligned unless told otherwise
TIMED_CALLS, ROUNDS = 5, 5  # calls per candidate per round; the median round counts
FINALISTS, FINAL_ROUNDS = 3, 15  # the fastest few are timed again, longer, against torch's call: candidates a few
# percent apart swapped places from one process to the next in 5 rounds (8B down_proj at 257 rows: 41 against 46 us)
FLUSH_L2S = 2  # a buffer of twice the GPU's L2 is read before each timed call
# how ``_choose`` times its candidates: "eager" (``time_calls``, each call launched on its own) or "graph"
# (``time_graphs``, the calls replayed from a CUDA graph, as the passes run them). Eagerly, a 27B down_proj's
# fitted tile at 257 rows took 76.7-82.6 us against torch's 84.3-84.6 on two H100s, and 87.7-89.5 against
# 84.7-85.3 replayed (benchmarks/results/wide_passes_h200.md, thirtieth session). Eager: whole 257-row passes
# chosen each way took the same time within their process-to-process spread on an H100 and an H200, both
# shapes (thirty-first session, ``benchmarks/h200_switches.sh timing``), and eager timing is the cheaper.
TIMING = "eager"
SPLIT_SIDES = (128, 176, 192, 256)  # tile sides along N (cuBLAS's at 256-257 rows) a split's first part fits
SPLIT_ROW_BLOCKS = (1, 2, 3)  # the blocks of x's rows those tiles may come in
SPLIT_LEAST = 1024  # the narrowest second part of a split
OP_T = 1  # cublasOperation_t CUBLAS_OP_T


@functools.cache
def available() -> bool:
    """nvmath-python is installed and loads cuBLASLt (its bindings load the library on first use)."""
    try:
        from nvmath.bindings import cublasLt

        cublasLt.get_version()
    except Exception:  # noqa: BLE001 - not installed, or no cuBLASLt it can load: torch's products then
        return False
    return True


def _lt():
    from nvmath.bindings import cublasLt

    return cublasLt


@functools.cache
def _handle(device_index: int) -> int:
    with torch.cuda.device(device_index):  # one per GPU, made on it; no stream in it: ``run`` names torch's
        return _lt().create()


@functools.cache
def _workspace(device: torch.device) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def _set(setter, target: int, attribute, value: np.ndarray) -> None:
    setter(target, int(attribute), value.ctypes.data, value.nbytes)


@dataclass
class Algorithm:
    """One cuBLASLt algorithm (its struct, copied out of the heuristic's list) and its workspace."""

    data: object  # nvmath's MatmulAlgo: 64 bytes that cublasLtMatmul reads
    workspace: int
    source: str  # "heuristic #i": its place in the list; "fitted TILE/CLUSTER": made by ``fitted``

    def config(self) -> dict[str, int]:
        """Its id, tile, stages, split count, reduction scheme and cluster shape, as cuBLASLt numbers them."""
        lt = _lt()
        out = {}
        for name in ("ID", "TILE_ID", "STAGES_ID", "SPLITK_NUM", "REDUCTION_SCHEME", "CLUSTER_SHAPE_ID"):
            attribute = lt.MatmulAlgoConfigAttribute[name]
            value = np.zeros(1, lt.get_matmul_algo_config_attribute_dtype(attribute))
            written = np.zeros(1, np.uint64)
            lt.matmul_algo_config_get_attribute(self.data.ptr, int(attribute), value.ctypes.data, value.nbytes,
                                                written.ctypes.data)
            out[name.lower()] = int(value[0])
        return out

    def describe(self) -> str:
        c = self.config()
        return (f"id {c['id']} tile {c['tile_id']} stages {c['stages_id']} split {c['splitk_num']} "
                f"reduce {c['reduction_scheme']} cluster {c['cluster_shape_id']}")


def variant(plan: "LtProduct", base: Algorithm, settings: dict[str, int], source: str) -> Algorithm | None:
    """``base`` with these config attributes (``MatmulAlgoConfigAttribute`` names) set, if
    ``cublasLtMatmulAlgoCheck`` accepts it for ``plan`` within the workspace; else None."""
    lt = _lt()
    check = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
    algo = lt.MatmulAlgo()
    ctypes.memmove(algo.ptr, base.data.ptr, lt.matmul_algo_dtype.itemsize)
    try:
        for name, value in settings.items():
            attribute = lt.MatmulAlgoConfigAttribute[name]  # each its own width (TILE_ID 16 bits, SPLITK_NUM 32)
            _set(lt.matmul_algo_config_set_attribute, algo.ptr, attribute,
                 np.array([value], lt.get_matmul_algo_config_attribute_dtype(int(attribute))))
        lt.matmul_algo_check(_handle(torch.cuda.current_device()), plan.desc, plan.a, plan.b, plan.c, plan.c,
                             algo.ptr, check.ctypes.data)
    except lt.cuBLASLtError:
        return None
    workspace = int(check[0]["workspace_size"])
    return Algorithm(algo, workspace, source) if workspace <= WORKSPACE_BYTES else None


@functools.cache
def _tiles() -> tuple[tuple[int, int, int], ...]:
    """(tile id, side along N, side along x's rows) of every tile cuBLASLt names ("TILE_64x136")."""
    named = _lt().MatmulTile.__members__.items()
    sized = ((int(tile), re.fullmatch(r"TILE_(\d+)x(\d+)", name)) for name, tile in named)
    return tuple((tile, int(size[1]), int(size[2])) for tile, size in sized if size)  # not TILE_UNDEFINED


def fitted_tiles(rows: int) -> list[int]:
    """Tile ids with a side of FIT_SIDES along N and, along x's rows, one of the FIT_WIDTHS widths
    that pad ``rows`` least (blocks x width - rows; the wider of equal paddings first: fewer blocks;
    none narrower than min(rows, 64))."""
    widths = sorted({width for _, side, width in _tiles() if side in FIT_SIDES and width >= min(rows, 64)},
                    key=lambda width: (-(-rows // width) * width - rows, -width))[:FIT_WIDTHS]
    return [tile for tile, side, width in _tiles() if side in FIT_SIDES and width in widths]


def fitted(plan: "LtProduct", base: Algorithm, rows: int) -> list[Algorithm]:
    """``base`` (the heuristic's first pick) with each of ``fitted_tiles(rows)`` in each FIT_CLUSTERS
    shape, K unsplit, where cuBLASLt's check accepts it."""
    clusters = [int(_lt().ClusterShape[f"SHAPE_{shape}"]) for shape in FIT_CLUSTERS]
    found = (variant(plan, base, {"TILE_ID": tile, "CLUSTER_SHAPE_ID": cluster, "SPLITK_NUM": 1,
                                  "REDUCTION_SCHEME": 0}, f"fitted {tile}/{cluster}")
             for tile in fitted_tiles(rows) for cluster in clusters)
    return [algo for algo in found if algo is not None]


def split_points(width: int, sms: int) -> list[int]:
    """Where ``Split`` may cut N: a first part of whole waves (``sms`` tiles each) of tiles SPLIT_SIDES
    wide in SPLIT_ROW_BLOCKS blocks of rows, at least a third of N, leaving at least SPLIT_LEAST."""
    points = {waves * (sms // blocks) * side for side in SPLIT_SIDES for blocks in SPLIT_ROW_BLOCKS
              for waves in range(1, width // max(1, (sms // blocks) * side) + 1)}
    return sorted(at for at in points if width / 3 <= at <= width - SPLIT_LEAST)


@dataclass
class LtChoice:
    """A cuBLASLt algorithm chosen for a shape, with the shape's descriptors."""

    plan: "LtProduct"
    algo: Algorithm

    @property
    def source(self) -> str:
        return self.algo.source

    def run(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.plan.run(x, weight, out, self.algo)

    def describe(self) -> str:
        return self.algo.describe()


@dataclass
class Split:
    """torch's call in two: the weight's rows [:at], then [at:], into those columns of one output. One
    call's tiles fill whole waves of the SMs but for its last, which runs part full; here the first part
    is whole waves and the second is priced on its own (at 257 rows faster for some wide products:
    ``benchmarks/results/wide_passes_h200.md``)."""

    at: int
    add: bool

    @property
    def source(self) -> str:
        return f"split at {self.at}"

    def run(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for part in (slice(None, self.at), slice(self.at, None)):  # column slices: cuBLAS takes their stride
            if self.add:
                out[:, part].addmm_(x, weight[part].t())
            else:
                torch.mm(x, weight[part].t(), out=out[:, part])
        return out

    def describe(self) -> str:
        return f"torch's call split at N = {self.at}"


class LtProduct:
    """The cuBLASLt descriptors of out [rows, width] (+)= x [rows, inner] @ weight [width, inner]^T."""

    def __init__(self, rows: int, width: int, inner: int, dtype: torch.dtype, add: bool):
        from nvmath import CudaDataType
        from nvmath.bindings.cublas import ComputeType  # cublasComputeType_t (nvmath.ComputeType is another enum)

        lt = _lt()
        data_type = int({torch.bfloat16: CudaDataType.CUDA_R_16BF, torch.float16: CudaDataType.CUDA_R_16F}[dtype])
        self.desc = lt.matmul_desc_create(int(ComputeType.COMPUTE_32F), int(CudaDataType.CUDA_R_32F))
        _set(lt.matmul_desc_set_attribute, self.desc, lt.MatmulDescAttribute.TRANSA, np.array([OP_T], np.int32))
        self.a = lt.matrix_layout_create(data_type, inner, width, inner)  # the weight, read transposed
        self.b = lt.matrix_layout_create(data_type, inner, rows, inner)  # x
        self.c = lt.matrix_layout_create(data_type, width, rows, width)  # out, as C and as D
        self.alpha = np.ones(1, np.float32)  # host scalars: read when the call is made (or captured)
        self.beta = np.array([1.0 if add else 0.0], np.float32)

    def heuristic(self, count: int) -> list[Algorithm]:
        """The algorithms cuBLASLt's heuristic offers for this shape on the current GPU, best first."""
        lt = _lt()
        handle = _handle(torch.cuda.current_device())
        preference = lt.matmul_preference_create()
        try:
            _set(lt.matmul_preference_set_attribute, preference, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES,
                 np.array([WORKSPACE_BYTES], np.uint64))
            results = lt.MatmulHeuristicResult(count)
            found = np.zeros(1, np.int32)
            lt.matmul_algo_get_heuristic(handle, self.desc, self.a, self.b, self.c, self.c, preference, count,
                                         results.ptr, found.ctypes.data)
        finally:
            lt.matmul_preference_destroy(preference)
        size = lt.matmul_heuristic_result_dtype.itemsize
        entries = np.frombuffer((ctypes.c_char * (size * count)).from_address(results.ptr),
                                dtype=lt.matmul_heuristic_result_dtype)
        offered = []
        for index in range(int(found[0])):
            if int(entries[index]["state"]) == 0:  # CUBLAS_STATUS_SUCCESS
                algo = lt.MatmulAlgo()
                ctypes.memmove(algo.ptr, results.ptr + index * size, lt.matmul_algo_dtype.itemsize)
                offered.append(Algorithm(algo, int(entries[index]["workspace_size"]), f"heuristic #{index}"))
        return offered

    def run(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, algo: Algorithm) -> torch.Tensor:
        """out (+)= x @ weight^T with ``algo`` on torch's current stream."""
        device = out.device  # x's, the weight's: a split target's later layers sit on another GPU
        workspace, size = (_workspace(device).data_ptr(), WORKSPACE_BYTES) if algo.workspace else (0, 0)
        _lt().matmul(_handle(device.index), self.desc, self.alpha.ctypes.data, weight.data_ptr(), self.a,
                     x.data_ptr(), self.b, self.beta.ctypes.data, out.data_ptr(), self.c, out.data_ptr(), self.c,
                     algo.data.ptr, workspace, size, torch.cuda.current_stream(device).cuda_stream)
        return out


_choosing = 0  # how many ``choosing()`` blocks are open


@contextlib.contextmanager
def choosing() -> Iterator[None]:
    """Inside: a product shape met for the first time (outside a capture) is timed and its algorithm chosen;
    so is an attention pass shape's form where ``attention_triton.SHARED`` is None."""
    global _choosing
    _choosing += 1
    try:
        yield
    finally:
        _choosing -= 1


def choosing_now() -> bool:
    """Whether a shape met for the first time now is timed: inside ``choosing()``, not capturing a graph."""
    return _choosing > 0 and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


# (device index, rows, N, K, summed, dtype) -> the choice (its ``run`` computes the product), or None: torch's call
_CHOSEN: dict[tuple, LtChoice | Split | None] = {}
_UNSEEN = object()
# the same keys -> (torch's call, the fastest offered algorithm: ms per TIMED_CALLS calls, its place)
_TIMES: dict[tuple, tuple[float, float, str]] = {}


def takes(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """CUDA, half precision, rows contiguous and aligned as the heuristic assumes, nvmath installed."""
    tensors = (x, weight) if out is None else (x, weight, out)
    return (ENABLED and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2
            and all(t.dtype == x.dtype and t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0 for t in tensors)
            and available())


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ weight^T, or out += it in place (``out`` given), by the algorithm chosen for this shape; None
    where torch's own call is the choice (the caller runs it) or ``takes`` refuses the operands."""
    if not (ENABLED and x.is_cuda and x.dim() == 2):
        return None
    rows, width = x.shape[0], weight.shape[0]
    key = (x.device.index, rows, width, x.shape[1], out is not None, x.dtype)
    chosen = _CHOSEN.get(key, _UNSEEN)
    if chosen is None or not takes(x, weight, out):  # the common case of an eager pass first: no more checks
        return None
    if chosen is _UNSEEN:
        with torch.cuda.device(x.device):  # the timing's events and streams: the operands' GPU, not the current one
            chosen = _CHOSEN[key] = _choose(x, weight, out is not None) if choosing_now() else None
        if chosen is None:
            return None
    return chosen.run(x, weight, out if out is not None else x.new_empty(rows, width))


def _choose(x: torch.Tensor, weight: torch.Tensor, add: bool) -> LtChoice | Split | None:
    """Time torch's call, each offered algorithm, each fitted one and each split on these operands, then
    torch's call and the FINALISTS fastest again over FINAL_ROUNDS; the fastest of those if it beats
    torch's call by MARGIN, else None."""
    plan = LtProduct(x.shape[0], weight.shape[0], x.shape[1], x.dtype, add)
    offered = [algo for algo in plan.heuristic(CANDIDATES) if algo.workspace <= WORKSPACE_BYTES]
    offered += fitted(plan, offered[0], x.shape[0]) if offered else []
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    candidates = [LtChoice(plan, algo) for algo in offered]
    candidates += [Split(at, add) for at in split_points(weight.shape[0], sms)]
    if not candidates:
        return None
    scratch = x.new_zeros(x.shape[0], weight.shape[0])

    def torch_call():
        return scratch.addmm_(x, weight.t()) if add else torch.mm(x, weight.t(), out=scratch)

    calls = [torch_call] + [functools.partial(choice.run, x, weight, scratch) for choice in candidates]
    timing = time_graphs if TIMING == "graph" else time_calls
    times = timing(calls, x.device)
    finalists = sorted(range(1, len(calls)), key=times.__getitem__)[:FINALISTS]
    final = timing([calls[0]] + [calls[i] for i in finalists], x.device, FINAL_ROUNDS)
    best = min(range(1, len(final)), key=final.__getitem__)
    choice = candidates[finalists[best - 1] - 1]
    key = (x.device.index, x.shape[0], weight.shape[0], x.shape[1], add, x.dtype)
    _TIMES[key] = (final[0], final[best], choice.source)
    return choice if final[best] < (1 - MARGIN) * final[0] else None


def report() -> list[str]:
    """A line per shape timed so far: torch's call against the fastest offered algorithm, and the choice."""
    lines = []
    for key, (torch_ms, best_ms, source) in _TIMES.items():
        _, rows, width, inner, add, _ = key
        chosen = _CHOSEN.get(key)
        shape = f"{rows:>5} x {width:>6} x {inner:>6}{' +=' if add else '   '}"
        lines.append(f"{shape}  torch {torch_ms / TIMED_CALLS * 1e3:7.1f} us  {source:>12} "
                     f"{best_ms / TIMED_CALLS * 1e3:7.1f} us  -> "
                     + (chosen.describe() if chosen else "torch's call"))
    return lines


def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    """A buffer FLUSH_L2S times the GPU's L2: read before each timed call, so that its weight comes from memory."""
    l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20
    return torch.zeros(FLUSH_L2S * l2_bytes // 2, dtype=torch.float16, device=device)


def _medians(timed: list[list[float]]) -> list[float]:
    """Each call's median over the rounds (``timed``: a list per round of each call's time)."""
    return [sorted(row[i] for row in timed)[len(timed) // 2] for i in range(len(timed[0]))]


def time_calls(calls: list, device: torch.device, rounds: int = ROUNDS) -> list[float]:
    """Each call's median over ``rounds`` of the sum of TIMED_CALLS runs (milliseconds, by CUDA events), a
    buffer larger than the L2 read before each run (read, not written: written lines would be written
    back during the timed call); the rounds interleave the calls, so a drift of the clocks hits all. Off
    CUDA (Triton's interpreter runs the kernels on the CPU) by the host's clock, with no flush."""
    if device.type != "cuda":
        timed = [[_host_ms(call) for call in calls] for _ in range(rounds)]
        return _medians(timed)
    flush = _l2_flush_buffer(device)
    for call in calls:  # first use: lazy set-up, workspace
        call()
    timed = []
    for _ in range(rounds):
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(TIMED_CALLS)] for _ in calls]
        torch.cuda._sleep(5_000_000)  # queue what follows behind it: the host's launch time is not timed
        for call, pairs in zip(calls, events):
            for begin, end in pairs:
                flush.amax()
                begin.record()
                call()
                end.record()
        torch.cuda.synchronize(device)
        timed.append([sum(begin.elapsed_time(end) for begin, end in pairs) for pairs in events])
    return _medians(timed)


def time_graphs(calls: list, device: torch.device, rounds: int = ROUNDS) -> list[float]:
    """As ``time_calls``, but as a pass runs the calls: each call's TIMED_CALLS runs, each after the read of a
    buffer larger than the L2, captured in one CUDA graph and replayed, less the same graph of the reads
    alone (ms per TIMED_CALLS runs, the median over ``rounds``, which interleave the graphs). Off CUDA,
    ``time_calls``. A capture that fails (a call that cannot be captured) falls back to ``time_calls``."""
    if device.type != "cuda":
        return time_calls(calls, device, rounds)
    flush = _l2_flush_buffer(device)
    for call in calls:  # first use: lazy set-up, workspace, outside any capture
        call()
    torch.cuda.synchronize(device)
    graphs = []
    try:
        for call in [None, *calls]:  # the reads alone first
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(TIMED_CALLS):
                    flush.amax()
                    if call is not None:
                        call()
            graphs.append(graph)
    except RuntimeError as exc:
        warnings.warn(f"lt_product: a candidate could not be captured to be timed ({exc!r}); timed eagerly",
                      stacklevel=2)
        return time_calls(calls, device, rounds)
    timed = []
    for _ in range(rounds):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in graphs]
        torch.cuda._sleep(5_000_000)  # queue what follows behind it: the host's launch time is not timed
        for graph, (begin, end) in zip(graphs, events, strict=True):
            begin.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize(device)
        timed.append([begin.elapsed_time(end) for begin, end in events])
    medians = _medians(timed)
    return [ms - medians[0] for ms in medians[1:]]


def _host_ms(call) -> float:
    begin = time.perf_counter()
    for _ in range(TIMED_CALLS):
        call()
    return (time.perf_counter() - begin) * 1e3
