"""A free TCP port, without torch: where a tensor-parallel group's ranks meet (the driver picks it,
``orchestrator.tp_group``; local test groups too, ``tools.local_group``)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` ("": every interface) that was free a moment ago (a group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
