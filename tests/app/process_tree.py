"""A process tree as ``/proc`` shows it, for the tests that end a CLI run from outside (Ctrl-C, a killed child)
and check that no process of it is left. Linux only (reads ``/proc``)."""

from __future__ import annotations

import os
from pathlib import Path


def descendant_pids(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (children, their children, ...), read from ``/proc/P/task/P/children``;
    a process that ends while it is read is left out. O(descendants)."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a process that still runs (a zombie, ended but not yet reaped, counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_all_ended(pids: set[int], hang_guard_s: float = 120.0) -> list[int]:
    """Wait until no process of ``pids`` runs (each is polled; the kernel ends a killed process asynchronously);
    returns those still running after ``hang_guard_s`` seconds (a guard against a hang, not a budget)."""
    import time

    end = time.monotonic() + hang_guard_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < end:
        os.sched_yield()
        time.sleep(0.05)
    return sorted(p for p in pids if pid_alive(p))


__all__ = ["descendant_pids", "pid_alive", "wait_all_ended"]
