"""Clean timing windows: wall time plus the CPU that OTHER processes used meanwhile.

Standard library only, so every benchmark process imports it (ours in the project's Python, the
peers in their own virtual environments, by path).

A window is one timed call (one whole GRPO step, one matmul). Around it we read the machine's busy
CPU time from ``/proc/stat`` (all CPUs: user + nice + system + irq + softirq + steal, in clock
ticks) and this process's own CPU time from ``/proc/self/stat`` (utime + stime, all threads).
Their difference is what every other process used while we were timing:

    other = (busy_all[t1] - busy_all[t0] - (own[t1] - own[t0])) / (n_cpus * (t1 - t0) * HZ)

as a fraction of the machine. A window with ``other > threshold`` (5% by default) is noisy and is
run again, up to a retry budget; the report says how many clean windows there were and, when it
could not get enough, that the number comes from noisy windows.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
N_CPUS = os.cpu_count() or 1


def _busy_all() -> int:
    """Busy clock ticks of all CPUs since boot (idle and iowait excluded; guest is in user)."""
    with open("/proc/stat") as fh:
        fields = fh.readline().split()[1:]
    v = [int(x) for x in fields]
    user, nice, system, _idle, _iowait, irq, softirq = v[:7]
    steal = v[7] if len(v) > 7 else 0
    return user + nice + system + irq + softirq + steal


def _own(pid: int | str = "self") -> int:
    """User + system clock ticks of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as fh:
        data = fh.read()
    rest = data[data.rindex(")") + 2 :].split()
    # rest[0] is field 3 (state); utime and stime are fields 14 and 15.
    return int(rest[11]) + int(rest[12])


def snapshot(pid: int | str = "self") -> tuple[float, int, int]:
    """(wall seconds, machine busy ticks, own ticks) at this instant."""
    return time.perf_counter(), _busy_all(), _own(pid)


def other_fraction(t0: tuple[float, int, int], t1: tuple[float, int, int]) -> float:
    """Fraction of the machine's CPU used by other processes between two snapshots."""
    wall = max(t1[0] - t0[0], 1e-9)
    other_ticks = (t1[1] - t0[1]) - (t1[2] - t0[2])
    return max(other_ticks, 0) / (N_CPUS * wall * HZ)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (VmHWM), in bytes; 0 where unavailable."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Windows:
    """Collects timed windows and decides when enough of them are clean.

    Args:
        wanted: Clean windows wanted.
        max_retries: Extra windows allowed beyond ``wanted`` to replace noisy ones.
        threshold: Largest other-process CPU fraction of a clean window.
    """

    def __init__(self, wanted: int, max_retries: int, threshold: float = 0.05) -> None:
        self.wanted = wanted
        self.max_retries = max_retries
        self.threshold = threshold
        self.records: list[dict[str, Any]] = []
        self._t0: tuple[float, int, int] | None = None

    def begin(self) -> None:
        self._t0 = snapshot()

    def end(self, **extra: Any) -> dict[str, Any]:
        t1 = snapshot()
        if self._t0 is None:
            msg = "Windows.end called before Windows.begin"
            raise RuntimeError(msg)
        rec = {
            "seconds": t1[0] - self._t0[0],
            "other_cpu": other_fraction(self._t0, t1),
            **extra,
        }
        rec["clean"] = rec["other_cpu"] <= self.threshold
        self.records.append(rec)
        self._t0 = None
        return rec

    def time(self, fn: Callable[[], Any], **extra: Any) -> dict[str, Any]:
        self.begin()
        fn()
        return self.end(**extra)

    @property
    def clean(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["clean"]]

    def done(self) -> bool:
        """Enough clean windows, or the retry budget is spent."""
        return len(self.clean) >= self.wanted or len(self.records) >= self.wanted + self.max_retries

    def run(self, fn: Callable[[], Any]) -> None:
        """Times ``fn`` until :meth:`done`."""
        while not self.done():
            self.time(fn)

    def summary(self, keys: tuple[str, ...] = ()) -> dict[str, Any]:
        """Median, min and max over the clean windows (all windows when none is clean).

        ``keys`` names extra per-window values (such as ``generation_s``) summarised the same way.
        """
        pool = self.clean
        ok = len(pool) >= self.wanted
        if not pool:
            pool = sorted(self.records, key=lambda r: r["other_cpu"])[: self.wanted]
        out: dict[str, Any] = {
            "clean_windows": len(self.clean),
            "windows": len(self.records),
            "wanted": self.wanted,
            "all_clean": ok,
            "other_cpu_max": max((r["other_cpu"] for r in pool), default=float("nan")),
            "other_cpu_all": [round(r["other_cpu"], 3) for r in self.records],
        }
        for r in self.records:
            if "generation_s" in r:  # everything after generation: reference, reward, update
                r["after_generation_s"] = r["seconds"] - r["generation_s"]
        if "generation_s" in keys:
            keys = (*keys, "after_generation_s")
        for key in ("seconds", *keys):
            vals = [r[key] for r in pool if key in r]
            if vals:
                out[key] = {
                    "median": statistics.median(vals),
                    "min": min(vals),
                    "max": max(vals),
                }
        return out


def emit(tag: str, result: dict[str, Any]) -> None:
    """Prints ``TAG {json}`` on one line: the record the orchestrator parses."""
    print(f"{tag} " + json.dumps(result), flush=True)
