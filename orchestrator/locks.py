"""Locks on the stores: one driver per study, and one process at a time creating a store's schema.

A lock must never outlive the process that holds it, however that process ends (SIGKILL, OOM
killer, a host that reboots), or a crash would leave the study blocked:

* SQLite (one host): an OS file lock (``fcntl.flock``) on a small file beside the database. The
  kernel drops it when the holder's file descriptor closes, which includes every kind of death.
  The file keeps the holder's pid and host so the refusal can name them.
* PostgreSQL (any host that reaches the server): a session-level advisory lock
  (``pg_try_advisory_lock``) on a connection the holder keeps open. The server drops it when that
  connection ends: at once when the process dies, and within about a minute when its host vanishes
  (the connection asks the server for TCP keepalives every 15 s, three probes). The holder is named
  through ``application_name`` in ``pg_stat_activity``.
* MySQL: ``GET_LOCK`` on a kept connection, the same semantics.
* Other URLs (e.g. an MLflow ``http://`` server, which serialises its own writes): no lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import socket
import time
from pathlib import Path

from workers.errors import SpecDecError

KEEPALIVE = "-c tcp_keepalives_idle=15 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3"


class StoreBusyError(SpecDecError):
    """Another live driver holds the lock."""


def holder_text() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}"


class _FileLock:
    def __init__(self, path: Path, wait: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = Path(path).read_text().strip() or "another process"
            os.close(self._fd)
            raise StoreBusyError(holder) from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, holder_text().encode())

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock; the file stays (removing it would race)
            self._fd = None


class _SessionLock:
    """A server-side lock tied to one open database connection."""

    def __init__(self, url: str, key: str, wait: bool) -> None:
        import sqlalchemy
        from sqlalchemy.pool import NullPool

        self.dialect = sqlalchemy.engine.make_url(url).get_backend_name()
        connect_args = {}
        if self.dialect == "postgresql":
            connect_args = {"application_name": f"specdec driver {holder_text()}"[:63], "options": KEEPALIVE}
        self._engine = sqlalchemy.create_engine(url, poolclass=NullPool, connect_args=connect_args)
        self._conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        self.key = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)
        self.name = "specdec:" + hashlib.sha256(key.encode()).hexdigest()[:48]  # MySQL: a name of <= 64
        if self.dialect == "postgresql":
            call = "pg_advisory_lock(:k)" if wait else "pg_try_advisory_lock(:k)"
            got = self._conn.execute(sqlalchemy.text(f"SELECT {call}"), {"k": self.key}).scalar()
            got = True if wait else bool(got)
        else:
            got = self._conn.execute(sqlalchemy.text("SELECT GET_LOCK(:n, :t)"),
                                     {"n": self.name, "t": -1 if wait else 0}).scalar() == 1
        if not got:
            holder = self._holder()
            self.release()
            raise StoreBusyError(holder)

    def _holder(self) -> str:
        if self.dialect != "postgresql":
            return "another connection"
        import sqlalchemy

        unsigned = self.key & 0xFFFFFFFFFFFFFFFF
        row = self._conn.execute(sqlalchemy.text(
            "SELECT a.application_name, a.client_addr FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = :hi AND l.objid = :lo AND l.objsubid = 1"),
            {"hi": unsigned >> 32, "lo": unsigned & 0xFFFFFFFF}).first()
        if row is None:
            return "another connection"
        name, address = row
        name = name.removeprefix("specdec driver ") if name else "another connection"
        return f"{name}" + (f" (client {address})" if address else "")

    def release(self) -> None:
        if self._conn is not None:
            self._conn.close()  # closing the session drops its locks
            self._engine.dispose()
            self._conn = None


def _sqlite_path(url: str) -> Path | None:
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        return Path(url.removeprefix("sqlite:///").split("?")[0].removeprefix("file:"))
    return None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@-]", "_", text)[:80] + "-" + hashlib.sha256(text.encode()).hexdigest()[:8]


def acquire(url: str, key: str, wait: bool = False):
    """Hold lock ``key`` on the store at ``url``; ``StoreBusyError`` (naming the holder) when taken.

    Returns an object with ``release()``, or None for stores without locks.
    """
    path = _sqlite_path(url)
    if path is not None:
        return _FileLock(path.with_name(f"{path.name}.{_slug(key)}.lock"), wait)
    if url.startswith(("postgresql", "mysql")):
        return _SessionLock(url, key, wait)
    return None


def release(lock) -> None:
    if lock is not None:
        lock.release()
