"""Counting XLA compilations in tests (JAX's monitoring events, from any thread)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA backend compilations while active: all, or of functions named like ``name``."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        self.count = 0
        self.active = False

    def __call__(self, event: str, duration: float, **kwargs: Any) -> None:
        if not self.active or event != COMPILE_EVENT:
            return
        if self.name is None or self.name in str(kwargs.get("fun_name", "")):
            self.count += 1

    def during(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` with the count reset and active; returns its result."""
        self.count, self.active = 0, True
        try:
            return fn()
        finally:
            self.active = False


def registered(counter: CompileCounter) -> Iterator[CompileCounter]:
    """Body of a fixture: the counter, listening for the rest of the test process."""
    jax.monitoring.register_event_duration_secs_listener(counter)
    yield counter
    counter.active = False
