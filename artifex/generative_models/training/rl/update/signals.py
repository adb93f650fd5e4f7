"""Signals in training: Ctrl-C held back while an update donates arrays, and a clean stop.

Two things, one place. :func:`interrupt_scope` and :func:`deferred_interrupt` keep a Ctrl-C
from landing between the programs of one update (each donates its arrays to XLA, so an
interrupt halfway would leave the model half updated with deleted buffers): the signal is
delivered once the caller stored the new state. :class:`StopSignals` is what the training loop
installs for a whole run: the first SIGTERM or SIGINT is recorded, the loop finishes its step,
saves a checkpoint and returns. Both handle the main thread only.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["StopSignals", "deferred_interrupt", "interrupt_scope"]

_log = logging.getLogger(__name__)

# Open interrupt scopes of the main thread (`interrupt_scope`), innermost last: each holds the
# interrupts caught while it was open and the SIGINT handler to restore (or _UNSET).
_UNSET = object()
_scopes: list[dict[str, Any]] = []


def _hold_interrupts(caught: list[Any]) -> Any:
    """Installs a SIGINT handler that records into ``caught``; returns the one it replaced.

    Returns ``_UNSET`` (nothing installed) where holding back is not possible or not needed:
    outside the main thread, where SIGINT is ignored, or where its handler was not installed
    from Python (it could not be restored).
    """
    if threading.current_thread() is not threading.main_thread():
        return _UNSET
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or previous == signal.SIG_IGN:
        return _UNSET
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    return previous


def _release_interrupts(previous: Any, caught: list[Any]) -> None:
    """Restores ``previous`` and delivers the first interrupt held back, if any, to it."""
    if previous is _UNSET:
        return
    signal.signal(signal.SIGINT, previous)
    if not caught:
        return
    if callable(previous):
        previous(signal.SIGINT, caught[0])  # Python's default handler raises KeyboardInterrupt
    else:  # SIG_DFL: the default action, as if the signal arrived now
        signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def interrupt_scope() -> Iterator[None]:
    """Delivers a Ctrl-C held back by :func:`deferred_interrupt` inside it at its end instead.

    A step whose optimizer runs group by group donates the old arrays to XLA (deletes them, their
    buffers reused) before it returns the new ones; the caller that stores the new state wraps the
    step and the store in this, so that an interrupt is raised only once the new state is stored.
    Nothing is held back until a :func:`deferred_interrupt` block starts inside (a Ctrl-C during
    tracing or compiling still interrupts at once). Nested scopes defer to the outermost; main
    thread only.

    Returns:
        A context manager.

    Examples:
        >>> import signal
        >>> from artifex.generative_models.training.rl.update.signals import (
        ...     deferred_interrupt, interrupt_scope)
        >>> order = []
        >>> try:
        ...     with interrupt_scope():
        ...         with deferred_interrupt():  # the groups' donating updates
        ...             signal.raise_signal(signal.SIGINT)
        ...             order.append("updated")
        ...         order.append("stored")  # the caller stores the new state
        ... except KeyboardInterrupt:
        ...     order.append("interrupted")
        >>> order
        ['updated', 'stored', 'interrupted']
    """
    if threading.current_thread() is not threading.main_thread() or _scopes:
        yield
        return
    scope: dict[str, Any] = {"caught": [], "previous": _UNSET}
    _scopes.append(scope)
    try:
        yield
    finally:
        _scopes.pop()
        _release_interrupts(scope["previous"], scope["caught"])


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Holds back Ctrl-C (SIGINT) inside the block and delivers it after; main thread only.

    The optimizer's per-group programs each donate their group's arrays to XLA (reuse their buffers
    for the new arrays): an interrupt between two of them would leave the model half updated, with
    the old arrays of the updated groups deleted. Inside an :func:`interrupt_scope` the interrupt is
    delivered when the scope ends (after the caller stored the new state); otherwise when this block
    ends. Where SIGINT is ignored, or its handler was not installed from Python, nothing is held
    back.

    Returns:
        A context manager.

    Examples:
        >>> import signal
        >>> from artifex.generative_models.training.rl.update.signals import deferred_interrupt
        >>> order = []
        >>> try:
        ...     with deferred_interrupt():
        ...         signal.raise_signal(signal.SIGINT)  # held back
        ...         order.append("updated")
        ...     order.append("after the block")  # not reached: delivered as the block ends
        ... except KeyboardInterrupt:
        ...     order.append("interrupted")
        >>> order
        ['updated', 'interrupted']
    """
    if _scopes:
        scope = _scopes[0]
        if scope["previous"] is _UNSET:
            scope["previous"] = _hold_interrupts(scope["caught"])
        yield
        return
    caught: list[Any] = []
    previous = _hold_interrupts(caught)
    try:
        yield
    finally:
        _release_interrupts(previous, caught)


class StopSignals:
    """Records SIGTERM and SIGINT so that a loop can finish its step, checkpoint and return.

    While installed, the first signal sets :attr:`received` (its name) instead of stopping the
    process. A second signal of the same kind while the first is pending behaves as if no
    handler were installed (SIGINT raises ``KeyboardInterrupt``), so a stuck run can still be
    stopped. Installing does nothing outside the main thread or when ``enabled`` is false.

    Args:
        enabled: Whether :meth:`install` installs the handlers.

    Examples:
        >>> import signal
        >>> from artifex.generative_models.training.rl.update.signals import StopSignals
        >>> stop = StopSignals(enabled=True)
        >>> stop.install()
        >>> signal.raise_signal(signal.SIGTERM)  # recorded, not fatal
        >>> stop.uninstall()
        >>> stop.received
        'SIGTERM'
    """

    def __init__(self, *, enabled: bool):
        self.enabled = enabled
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            self.uninstall()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(signum)
            return
        self.received = name
        _log.warning(
            f"{name} received: finishing the current step, then saving a checkpoint "
            "(send it again to stop at once)"
        )

    def install(self) -> None:
        """Installs the handlers (main thread only, when enabled)."""
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Restores the handlers that were there before :meth:`install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
