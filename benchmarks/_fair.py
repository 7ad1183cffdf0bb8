"""Equal terms for the benchmarks that time umalloc against a peer (not a benchmark itself).

* :func:`set_threads`: one CPU thread count for torch and numba in this process and, through ``OMP_NUM_THREADS`` /
  ``MKL_NUM_THREADS`` / ``NUMBA_NUM_THREADS`` in :func:`peer_env`, in every peer process started with that
  environment (torch and numba read those at start-up); set once, printed once.
* :func:`load`: the machine load (``os.getloadavg``) as one printable string, printed at the start of each round
  and at the end.
* :func:`round_ratios`: each round's ratio and their median, one printable line.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence

import numba
import torch

#: the thread count the peer benchmarks use unless told otherwise (a shared 2-core host: one thread per side is
#: the steadiest, and the same for both)
DEFAULT_THREADS = 1
_threads = 0   # what set_threads set (0: not called)


def set_threads(n: int) -> str:
    """Set ``n`` CPU threads for torch and numba here and for peer processes started later; returns the line to
    print. Raises SystemExit for ``n < 1``."""
    global _threads
    if n < 1:
        raise SystemExit(f"--threads {n}: allowed >= 1")
    _threads = n
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))  # first: starting numba's pool may reset torch's
    torch.set_num_threads(n)
    return (f"# threads: torch {torch.get_num_threads()}, numba {numba.get_num_threads()} for umalloc and the peer "
            f"alike (peer processes: OMP_NUM_THREADS={n}); {os.cpu_count()} CPUs")


def peer_env() -> dict[str, str]:
    """This process's environment with the thread count :func:`set_threads` set, for a peer process (torch and numba
    read these at start-up; this process's own numba must not see ``NUMBA_NUM_THREADS`` change, so it is never
    set here)."""
    env = dict(os.environ)
    if _threads:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
            env[var] = str(_threads)
    return env


def load() -> str:
    """``load 1/5/15 min a/b/c`` from ``os.getloadavg()``."""
    a, b, c = os.getloadavg()
    return f"load 1/5/15 min {a:.2f}/{b:.2f}/{c:.2f}"


def round_ratios(label: str, ratios: Sequence[float]) -> str:
    """``label``, each round's ratio, then their median (the figure least moved by load that drifts between
    rounds)."""
    return f"  {label:<24} " + " ".join(f"{x:5.2f}" for x in ratios) + f"   median {statistics.median(ratios):.2f}"
