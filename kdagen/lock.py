"""A cross-process file lock that cannot go stale.

``fcntl.flock`` locks belong to the open file: the kernel drops them when their
owner exits, however it exits (kill -9 included), so a dead builder never blocks the
next one. The lock file records the holder's pid for the waiting message only.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path


class FileLock:
    """``with FileLock(path):`` holds an exclusive lock on ``path`` (created)."""

    def __init__(self, path: Path, *, timeout: float | None = None, quiet: bool = False):
        self.path = Path(path)
        self.timeout = timeout
        self.quiet = quiet
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        start = time.monotonic()
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told and not self.quiet:
                    holder = _read_holder(self.path)
                    print(f"kdagen: waiting for {self.path.name} (held by pid {holder})",
                          file=sys.stderr)
                    told = True
                if self.timeout is not None and time.monotonic() - start > self.timeout:
                    os.close(fd)
                    raise TimeoutError(f"could not lock {self.path} within {self.timeout} s")
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "FileLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"
