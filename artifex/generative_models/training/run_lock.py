"""One run per directory at a time: a lock file that names the run holding it.

A training run writes its checkpoints, logs and exported model into directories that a second
run started by mistake (the same command in two terminals, two jobs of one array pointing at
one place) would write into as well: both would finish, with mixed checkpoints and logs and
the export of whichever ended last. :class:`RunLock` takes a directory for one run: it creates
``.artifex-run.lock`` in it with ``O_CREAT | O_EXCL`` (atomic on local and NFS v3+ file
systems), holding the process id, the host name and the process's start time, and removes it
when the run ends.

A directory whose lock names a live process is refused with :class:`DirectoryInUseError`,
naming that process. A lock whose process is gone (a run killed with ``SIGKILL``, a machine
that rebooted: its pid is not running on this host, or runs a process started at another
time) is taken over with a warning. A lock written on another host cannot be checked from here
and is refused; the error says which file to delete once that run is known to be over.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from typing import Any

__all__ = ["LOCK_NAME", "DirectoryInUseError", "RunLock"]

_log = logging.getLogger(__name__)

#: The lock file's name inside the locked directory.
LOCK_NAME = ".artifex-run.lock"

# Locks this process holds: real path of the lock file -> [token, holders]. A directory used
# twice by one run (a log directory that is also the checkpoint directory) is locked once.
_HELD: dict[str, list[Any]] = {}
_HELD_GUARD = threading.Lock()


class DirectoryInUseError(RuntimeError):
    """Another run (a live process) holds the directory's lock.

    Args:
        message: The error message (names the directory, the other run and what to do).
        pid: The other run's process id.
        host: The host it runs on.
        lock_file: The lock file's path.

    Attributes:
        pid: The other run's process id.
        host: The host it runs on.
        lock_file: The lock file's path.

    Examples:
        >>> from artifex.generative_models.training.run_lock import DirectoryInUseError
        >>> err = DirectoryInUseError("in use", pid=42, host="node-1", lock_file="/x/.lock")
        >>> err.pid, err.host, isinstance(err, RuntimeError)
        (42, 'node-1', True)
    """

    def __init__(self, message: str, *, pid: int, host: str, lock_file: str):
        super().__init__(message)
        self.pid = pid
        self.host = host
        self.lock_file = lock_file


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, Linux), or ``None``."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces
    return fields[19] if len(fields) > 19 else None


def _alive(record: dict[str, Any]) -> bool | None:
    """``True``/``False`` for a lock of this host; ``None`` when it cannot be checked here."""
    if record.get("host") != socket.gethostname():
        return None
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: a live process of another user
        pass
    started = record.get("started")
    if started is not None:
        now = _start_time(pid)
        if now is not None and now != started:
            return False  # the pid was reused by a process started later
    return True


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


class RunLock:
    """Holds a directory for one run: ``with RunLock(path, "--output"): ...``.

    Args:
        directory: The directory (created if needed).
        what: How errors and warnings name it (``"--output"``, ``"TrainConfig.log_dir"``).

    Raises:
        DirectoryInUseError: (on :meth:`acquire`) a live process, or a process on another host,
            holds the directory.

    Examples:
        >>> import os, tempfile
        >>> from artifex.generative_models.training.run_lock import LOCK_NAME, RunLock
        >>> directory = tempfile.mkdtemp()
        >>> with RunLock(directory, "--output"):
        ...     os.path.exists(os.path.join(directory, LOCK_NAME))
        True
        >>> os.path.exists(os.path.join(directory, LOCK_NAME))  # released
        False
    """

    def __init__(self, directory: str | os.PathLike[str], what: str = "directory"):
        self.directory = os.path.abspath(os.fspath(directory))
        self.what = what
        self.path = os.path.join(self.directory, LOCK_NAME)
        self._key: str | None = None

    def acquire(self) -> RunLock:
        """Takes the lock (or joins this process's own hold of it).

        Returns:
            ``self``.

        Raises:
            DirectoryInUseError: Another live run holds it, or a run on another host.
        """
        os.makedirs(self.directory, exist_ok=True)
        key = os.path.realpath(self.path)
        with _HELD_GUARD:
            if key in _HELD:
                _HELD[key][1] += 1
                self._key = key
                return self
            token = self._create(key)
            _HELD[key] = [token, 1]
            self._key = key
        return self

    def _create(self, key: str) -> str:
        token = secrets.token_hex(8)
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": _start_time(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": " ".join(sys.argv)[:300],
            "token": token,
        }
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                fd = None
            if fd is None:
                other = _read(self.path)
                for _ in range(10):  # being written this instant (or torn by a kill)
                    if other is not None or not os.path.exists(self.path):
                        break
                    time.sleep(0.1)
                    other = _read(self.path)
                if other is None:
                    self._take_over(None, key)
                    continue
                alive = _alive(other)
                if alive is False:
                    self._take_over(other, key)
                    continue
                pid, host = other.get("pid"), other.get("host")
                where = "this host" if alive else f"host {host}"
                fix = (
                    "wait for it to finish or stop it"
                    if alive
                    else f"if that run is over, delete {self.path}"
                )
                msg = (
                    f"{self.what} {self.directory} is in use by another run: pid {pid} on "
                    f"{where} (since {other.get('since', '?')}, lock {self.path}): {fix}, or "
                    "choose another directory"
                )
                raise DirectoryInUseError(msg, pid=pid, host=str(host), lock_file=self.path)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(record, fh)
                fh.flush()
                with contextlib.suppress(OSError):
                    os.fsync(fh.fileno())
            return token
        msg = f"{self.what} {self.directory}: cannot create the lock file {self.path}"
        raise OSError(msg)

    def _take_over(self, stale: dict[str, Any] | None, key: str) -> None:
        """Removes a lock whose process is gone (renamed away first: one taker wins)."""
        aside = f"{self.path}.stale-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another run took it over first; try to create it again
        taken = _read(aside)
        if stale is not None and taken is not None and taken.get("token") != stale.get("token"):
            # A run created a fresh lock between our read and the rename: give it back.
            with contextlib.suppress(OSError):
                os.rename(aside, self.path)
            return
        with contextlib.suppress(OSError):
            os.remove(aside)
        who = (
            "an unreadable lock"
            if stale is None
            else (
                f"the lock of pid {stale.get('pid')} on {stale.get('host')}, which is no longer "
                "running"
            )
        )
        _log.warning(f"{self.what} {self.directory}: took over {who} ({self.path})")

    def release(self) -> None:
        """Gives the lock back (the file is removed when this process's last hold ends)."""
        key, self._key = self._key, None
        if key is None:
            return
        with _HELD_GUARD:
            held = _HELD.get(key)
            if held is None:
                return
            held[1] -= 1
            if held[1] > 0:
                return
            del _HELD[key]
            record = _read(self.path)
            if record is not None and record.get("token") == held[0]:
                with contextlib.suppress(OSError):
                    os.remove(self.path)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
