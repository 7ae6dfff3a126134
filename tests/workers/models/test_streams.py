"""Work on side streams (``workers.models.streams``) and the round's read that marks where the walk ends
(``workers.decoding.generation.ReadLater``): ordered as one launch would be, eagerly and in graphs.

The GPU tests hold the current stream back with ``torch.cuda._sleep`` (tens of milliseconds of
spinning) before the work a side stream must wait for, so a missing fork or join shows up as wrong
values, not as a race that rarely loses."""

from __future__ import annotations

import pytest
import torch

from workers.decoding import generation
from workers.decoding.generation import ReadLater
from workers.models.streams import branches

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SPIN = 50_000_000  # GPU cycles: about 25-50 ms


def test_off_cuda_everything_runs_in_line(monkeypatch):
    monkeypatch.setattr(generation, "COMMIT_BESIDE_DRAFT", True)
    x = torch.arange(4.0)
    with branches(torch.device("cpu"), 3) as on:
        for k in range(3):
            with on(k):
                x += 1
    read = ReadLater(x)
    with read.beside(torch.device("cpu")):
        x *= 2
    assert read() is x and x.tolist() == [6.0, 8.0, 10.0, 12.0]


def _branched(device, x, outs):
    """Each branch k waits a different while, then writes x + k into outs[k]."""
    with branches(device, 3) as on:
        for k, out in enumerate(outs):
            with on(k):
                torch.cuda._sleep(SPIN // 10 * (4 - k))
                torch.add(x, k, out=out)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
def test_branches_start_after_the_stream_and_it_resumes_after_them(graphed):
    device = torch.device("cuda")
    x = torch.zeros(1 << 16, device=device)
    outs = [torch.zeros_like(x) for _ in range(4)]  # four pieces on three streams: one shares
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _branched(device, x, outs)
    torch.cuda.synchronize()
    for value in (1.0, 2.0):
        torch.cuda._sleep(SPIN)  # a branch not forked from here would run first and read the old x
        x.fill_(value)
        graph.replay() if graphed else _branched(device, x, outs)
        total = torch.stack(outs).sum(0)  # not joined back: it would read the branches' outputs unwritten
        assert torch.equal(total, torch.full_like(x, 4 * value + 6)), (graphed, value)


@pytest.mark.gpu
@needs_cuda
def test_work_beside_waits_for_the_read_only_and_the_stream_for_it(monkeypatch):
    """The commit's pattern: the walk, its read started, the next draft queued (here a long spin and a
    write the commit must not see), then the commit beside that draft; what follows sees the commit."""
    monkeypatch.setattr(generation, "COMMIT_BESIDE_DRAFT", True)
    device = torch.device("cuda")
    walk = torch.zeros(1 << 16, device=device)
    committed = torch.zeros_like(walk)
    torch.cuda._sleep(SPIN)  # the verify pass: the read must wait for it
    walk.fill_(3.0)
    read = ReadLater(walk[:4])
    torch.cuda._sleep(SPIN)  # the next draft, queued before the host read
    walk.fill_(-1.0)  # ... whose work the commit does not wait for
    assert read().tolist() == [3.0] * 4
    with read.beside(device):
        torch.add(walk, 1.0, out=committed)  # ran during the spin: it saw the walk, not the draft's write
    after = committed * 2  # the current stream, after the commit
    assert torch.equal(after, torch.full_like(walk, 8.0))
    monkeypatch.setattr(generation, "COMMIT_BESIDE_DRAFT", False)  # in line: after the draft's write
    walk.fill_(3.0)
    read = ReadLater(walk[:4])
    torch.cuda._sleep(SPIN)
    walk.fill_(-1.0)
    with read.beside(device):
        torch.add(walk, 1.0, out=committed)
    assert torch.equal(committed, torch.zeros_like(walk))
