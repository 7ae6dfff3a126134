"""Programmatic dependent launch (PDL) for the project's Triton kernels, on Hopper and later GPUs.

A kernel launched with PDL may start before the kernel ahead of it in the stream has finished: its
programs become resident as the earlier kernel's programs finish (or, where that kernel says so, once
they have all started), and each waits at its first line until the earlier kernel has completed and
its writes are visible. The launch latency between two kernels then overlaps the earlier one's tail.

Every kernel here begins with ``wait_for_inputs(PDL)``: under PDL it waits (``griddepcontrol.wait``)
before touching memory, so it is safe behind any kernel, PDL-launched or not; in the WAIT_AND_RELEASE
mode it then lets the next kernel launch at once (``griddepcontrol.launch_dependents``; that kernel
waits in turn for this one's end). A launch passes ``**launch_options(tensor.device)``: the ``PDL``
mode and Triton's ``launch_pdl``, on only inside ``kernels.dependent_launches`` (AR's one-row pass)
on a GPU of compute capability 9 or more, and not when the environment sets ``WORKERS_PDL=0``; off
elsewhere (Ampere, the CPU interpreter), where the kernels compile as they did without it.
``benchmarks/pdl_ab.py`` measures the modes against launches without PDL, pass by pass.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from workers.models.kernels import dependent_launches_on

SWITCH = "WORKERS_PDL"
# what a kernel does at its first line under PDL: wait for the kernel before; or wait, then let the next
# one launch at once (its programs resident, waiting, beside this kernel's last ones)
WAIT, WAIT_AND_RELEASE = 1, 2
MODE = WAIT_AND_RELEASE
_OFF = {"PDL": 0}


@functools.cache
def _enabled(device_index: int) -> bool:
    if os.environ.get(SWITCH, "1").strip() == "0":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """The keyword arguments that switch PDL on or off for a launch on ``device``: on inside
    ``kernels.dependent_launches`` on a GPU that has it."""
    if device.type != "cuda" or not dependent_launches_on():
        return _OFF
    if not _enabled(torch.cuda.current_device() if device.index is None else device.index):
        return _OFF
    return {"PDL": MODE, "launch_pdl": True}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """A kernel's first line: with PDL, wait for the kernel before (its writes visible), then let the
    next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 2:  # WAIT_AND_RELEASE (a module global is not a constexpr inside a kernel)
        tl.extra.cuda.gdc_launch_dependents()
