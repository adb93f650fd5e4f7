"""Starting a multi-process run within a bounded time, with a one-line error when it cannot.

``jax.distributed.initialize`` prints nothing while it waits for the other processes, and when
one never comes it aborts the process (``SIGABRT``, a C++ stack trace) after
``initialization_timeout`` seconds (300 by default) without saying which one is missing; a
misspelled coordinator address can make it wait as long. :func:`join_processes` goes first:

1. the coordinator address is checked (``host:port``, a valid host name or IP address that
   resolves, a port in 1-65535) before anything is started;
2. the processes meet in a small TCP handshake on the coordinator's port: process 0 listens,
   every other process connects and says who it is (its process id and the number of
   processes it was started with). Process 0 knows which ids arrived, so when one does not
   come within ``timeout`` seconds, every waiting process stops with a
   :class:`DistributedStartError` naming the missing process ids and the address; a process
   that finds no process 0 says so;
3. only then is ``jax.distributed.initialize`` called (given ``timeout`` plus a margin as its
   own ``initialization_timeout``), under a watchdog that ends the process with a one-line
   message should it still not return.

The handshake's listening socket is closed before JAX's coordination service binds the port.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistributedStartError",
    "join_processes",
    "parse_coordinator_address",
    "wait_for_processes",
]

#: Seconds every process waits for the others by default (``--distributed-timeout``).
DEFAULT_TIMEOUT_S = 300.0

_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_HELLO = "artifex-join"


class DistributedStartError(RuntimeError):
    """A multi-process run could not start: a process did not come, or none answered.

    Examples:
        >>> from artifex.generative_models.training.rendezvous import DistributedStartError
        >>> issubclass(DistributedStartError, RuntimeError)
        True
    """


def parse_coordinator_address(
    address: str, *, what: str = "--coordinator-address"
) -> tuple[str, int]:
    """Splits and checks ``host:port`` (``[v6 address]:port`` for IPv6).

    Args:
        address: The coordinator address.
        what: How errors name it.

    Returns:
        ``(host, port)``.

    Raises:
        ValueError: Not ``host:port``, a host that is neither an IP address nor a valid host
            name (letters, digits, ``-`` and ``.``), or a port outside 1-65535.

    Examples:
        >>> from artifex.generative_models.training.rendezvous import parse_coordinator_address
        >>> parse_coordinator_address("10.0.0.1:1234"), parse_coordinator_address("[::1]:80")
        (('10.0.0.1', 1234), ('::1', 80))
        >>> parse_coordinator_address("not_a_host:99999")
        Traceback (most recent call last):
            ...
        ValueError: --coordinator-address 'not_a_host:99999': port 99999 is outside 1-65535 ...
    """
    text = str(address).strip()
    where = f"{what} {address!r}"
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
    else:
        host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        msg = f"{where}: expected host:port (e.g. 10.0.0.1:1234, or [::1]:1234 for IPv6)"
        raise ValueError(msg)
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        msg = f"{where}: port {port_text} is outside 1-65535 (expected host:port)"
        raise ValueError(msg)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        labels = host.rstrip(".").split(".")
        if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
            msg = (
                f"{where}: {host!r} is not an IP address or a valid host name (letters, digits, "
                "'-' and '.' only)"
            )
            raise ValueError(msg) from None
    return host, int(port_text)


def _resolve(host: str, port: int, timeout: float, where: str) -> None:
    """Raises ``ValueError`` when ``host`` does not resolve within ``timeout`` seconds."""
    result: list[Any] = []

    def lookup() -> None:
        try:
            result.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as err:
            result.append(err)

    thread = threading.Thread(target=lookup, daemon=True)
    thread.start()
    thread.join(timeout)
    if not result:
        msg = f"{where}: looking up the host {host!r} took more than {timeout:g} s"
        raise ValueError(msg)
    if isinstance(result[0], OSError):
        msg = f"{where}: cannot resolve the host {host!r} ({result[0]})"
        raise ValueError(msg)


def _readline(conn: socket.socket, limit: int = 256) -> str:
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        chunk = conn.recv(limit - len(data))
        if not chunk:
            break
        data += chunk
    return data.decode("ascii", errors="replace").strip()


def _missing(ids: list[int]) -> str:
    return ("process " if len(ids) == 1 else "processes ") + ", ".join(map(str, ids))


def wait_for_processes(
    address: str, num_processes: int, process_id: int, timeout: float = DEFAULT_TIMEOUT_S
) -> None:
    """Waits until all ``num_processes`` processes have reached the coordinator's port.

    Process 0 listens on the port of ``address`` and waits for processes ``1 .. N-1`` to
    connect; each of those connects (retrying until process 0 listens) and waits for process
    0's go-ahead. Nothing happens for ``num_processes == 1``.

    Args:
        address: ``host:port`` of process 0 (checked as by :func:`parse_coordinator_address`).
        num_processes: Processes in the run.
        process_id: This process's id.
        timeout: Seconds to wait for the others (a non-zero process may wait up to twice as
            long: for process 0 to listen, then for its go-ahead).

    Raises:
        DistributedStartError: A process did not come in time (process 0 names the missing
            ids), no process 0 answered, two processes claimed one id, or a process was
            started with another number of processes.
        ValueError: A bad address or ``timeout``.

    Examples:
        >>> import socket, threading
        >>> from artifex.generative_models.training.rendezvous import (
        ...     DistributedStartError, wait_for_processes)
        >>> with socket.socket() as s:  # a free port for process 0
        ...     s.bind(("127.0.0.1", 0))
        ...     address = f"127.0.0.1:{s.getsockname()[1]}"
        >>> process_1 = threading.Thread(target=wait_for_processes, args=(address, 2, 1, 30))
        >>> process_1.start()
        >>> wait_for_processes(address, 2, 0, timeout=30)  # returns once process 1 has come
        >>> process_1.join()
        >>> try:
        ...     wait_for_processes(address, 2, 0, timeout=0.5)  # process 1 does not come again
        ... except DistributedStartError as error:
        ...     print(error)
        process 0 of 2: process 1 did not join at 127.0.0.1:... within 0.5 s ...
    """
    if not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
        msg = f"--distributed-timeout must be a number of seconds > 0, got {timeout!r}"
        raise ValueError(msg)
    host, port = parse_coordinator_address(address)
    if num_processes <= 1:
        return
    who = f"process {process_id} of {num_processes}"
    if process_id == 0:
        _serve(address, port, num_processes, timeout, who)
    else:
        _join(address, host, port, num_processes, process_id, timeout, who)


def _serve(address: str, port: int, n: int, timeout: float, who: str) -> None:
    try:
        if socket.has_dualstack_ipv6():
            server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            server = socket.create_server(("", port))
    except OSError as err:
        msg = (
            f"{who}: cannot listen on port {port} of --coordinator-address {address} "
            f"({err.strerror or err}): choose a free port"
        )
        raise DistributedStartError(msg) from err
    joined: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout
    server.settimeout(0.2)
    try:
        while len(joined) < n - 1:
            if time.monotonic() >= deadline:
                missing = [i for i in range(1, n) if i not in joined]
                msg = (
                    f"{who}: {_missing(missing)} did not join at {address} within {timeout:g} s "
                    f"(--distributed-timeout): start every process with --coordinator-address "
                    f"{address} --num-processes {n} and its own --process-id (0 to {n - 1})"
                )
                _abort(joined, f"{_missing(missing)} did not join within {timeout:g} s")
                raise DistributedStartError(msg)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(5.0)
            try:
                words = _readline(conn).split()
            except OSError:
                conn.close()
                continue
            if len(words) != 3 or words[0] != _HELLO or not all(w.isdigit() for w in words[1:]):
                conn.close()  # not one of ours
                continue
            pid, their_n = int(words[1]), int(words[2])
            problem = None
            if their_n != n:
                problem = (
                    f"process {pid} was started with --num-processes {their_n}, process 0 with {n}"
                )
            elif not 1 <= pid < n or pid in joined:
                problem = f"two processes were started with --process-id {pid}"
            if problem is not None:
                _abort({**joined, pid: conn} if pid not in joined else joined, problem)
                conn.close()
                msg = f"{who}: {problem} (--coordinator-address {address})"
                raise DistributedStartError(msg)
            joined[pid] = conn
        for conn in joined.values():
            with contextlib.suppress(OSError):
                conn.sendall(b"go\n")
        for conn in joined.values():  # they close first: no TIME_WAIT on this side of the port
            with contextlib.suppress(OSError):
                conn.settimeout(5.0)
                conn.recv(16)
    finally:
        for conn in joined.values():
            conn.close()
        server.close()


def _abort(joined: dict[int, socket.socket], reason: str) -> None:
    for conn in joined.values():
        with contextlib.suppress(OSError):
            conn.sendall(f"abort {reason}\n".encode("ascii", errors="replace"))


def _join(address: str, host: str, port: int, n: int, pid: int, timeout: float, who: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            conn = socket.create_connection((host, port), timeout=max(min(left, 5.0), 0.1))
            break
        except OSError as err:
            if time.monotonic() >= deadline:
                msg = (
                    f"{who}: no answer from process 0 (the coordinator) at {address} within "
                    f"{timeout:g} s (--distributed-timeout; last: {err.strerror or err}): start "
                    "process 0 with the same --coordinator-address, or check the address"
                )
                raise DistributedStartError(msg) from err
            time.sleep(0.3)
    try:
        conn.sendall(f"{_HELLO} {pid} {n}\n".encode("ascii"))
        conn.settimeout(timeout + 30.0)  # process 0 decides when the others are late
        try:
            reply = _readline(conn)
        except OSError as err:
            reply = f"abort no answer ({err})"
    finally:
        conn.close()
    if reply == "go":
        return
    reason = reply[len("abort ") :] if reply.startswith("abort ") else "it closed the connection"
    msg = f"{who}: process 0 at {address} stopped the start: {reason}"
    raise DistributedStartError(msg)


@contextlib.contextmanager
def _watchdog(seconds: float, message: str) -> Iterator[None]:
    """Ends the process with ``message`` (status 2) unless the block finishes in time."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(seconds):
            print(message, file=sys.stderr, flush=True)
            os._exit(2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def join_processes(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    timeout: float = DEFAULT_TIMEOUT_S,
    *,
    initialize: Callable[..., Any] | None = None,
    **kwargs: Any,
) -> None:
    """Checks the address, waits for every process, then calls ``jax.distributed.initialize``.

    With all three of ``coordinator_address``, ``num_processes`` and ``process_id`` known, the
    address is checked and resolved and the processes meet first
    (:func:`wait_for_processes`); otherwise (cluster auto-detection) JAX alone waits. Either
    way ``initialize`` gets ``initialization_timeout=timeout + 30`` and runs under a watchdog
    that prints one line and exits with status 2 after ``timeout + 20`` seconds.

    Args:
        coordinator_address: ``host:port`` of process 0, or ``None`` (auto-detection).
        num_processes: Processes in the run, or ``None``.
        process_id: This process's id, or ``None``.
        timeout: Seconds to wait for the others (``--distributed-timeout``).
        initialize: The function to call (``jax.distributed.initialize`` by default).
        **kwargs: More arguments for it.

    Raises:
        ValueError: A bad address or ``timeout`` (before anything starts).
        DistributedStartError: The processes did not all come (see
            :func:`wait_for_processes`).

    Examples:
        >>> from artifex.generative_models.training.rendezvous import join_processes
        >>> def initialize(**kwargs):  # stands in for jax.distributed.initialize
        ...     print(sorted(kwargs))
        >>> join_processes("127.0.0.1:12345", 1, 0, timeout=5, initialize=initialize)
        ['coordinator_address', 'initialization_timeout', 'num_processes', 'process_id']
    """
    if not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
        msg = f"--distributed-timeout must be a number of seconds > 0, got {timeout!r}"
        raise ValueError(msg)
    where = f"--coordinator-address {coordinator_address!r}"
    if coordinator_address is not None:
        host, port = parse_coordinator_address(coordinator_address)
        _resolve(host, port, min(timeout, 30.0), where)
        if num_processes is not None and process_id is not None:
            wait_for_processes(coordinator_address, num_processes, process_id, timeout)
    if initialize is None:
        import jax

        initialize = jax.distributed.initialize
    who = "this process" if process_id is None else f"process {process_id}"
    message = (
        f"artifex-grpo: error: {who}: jax.distributed.initialize did not finish within "
        f"{timeout + 20:g} s ({where}, --distributed-timeout {timeout:g}): check that every "
        "process can reach the coordinator"
    )
    with _watchdog(timeout + 20.0, message):
        initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=math.ceil(timeout) + 30,
            **kwargs,
        )
