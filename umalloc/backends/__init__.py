"""Transfer backends: the :class:`TransferBackend` protocol, its handles, and the three implementations.

Policy:

* One protocol, three implementations: ``local`` (in-process copies, the embedded default and the reference),
  ``nixl`` (a real NIXL agent, UCX) and ``mooncake`` (a real Mooncake TransferEngine, TCP over loopback).
  Every one passes the same conformance suite (``tests/backends/test_backends.py``).
* Importing :mod:`umalloc.backends` never imports an engine: :func:`get_backend` imports the implementation
  module on first use, and a missing engine raises :class:`~umalloc.errors.BackendUnavailable`.
* Transfers are WRITEs pushed by the sender: ``submit(plan, peer)`` posts ``plan.descriptors()`` — an
  ``(N, 3)`` ``uint64`` array of ``(src_addr, dst_addr, nbytes)`` — and returns a :class:`TransferHandle`.
  A plan's leases are released exactly once, in the caller's thread, when its handle reaches a terminal state
  (``plan.complete()`` on success, ``plan.fail(exc)`` on failure or deadline, ``plan.abort()`` when a pending
  handle is forgotten) — and never while the engine may still read or write the plan's pages: a handle failed
  by a deadline or a ``forget`` while the engine still holds one of its parts is ``draining``, and its plan finishes
  when the engine confirms (Note [Deadlines and in-flight parts] in :mod:`umalloc.backends.handle`).
* Every wait is bounded: ``wait(handle, timeout_s)`` raises :class:`~umalloc.errors.TransferTimeout` at the
  deadline and :class:`~umalloc.errors.TransferError` for a failed or dead peer, never hangs;
  ``drain(handle, timeout_s)`` waits, bounded too, for a draining handle's plan to end.
* Modules, one concept each, imported one way (left needs nothing on its right): ``handle`` (handles, their
  lifecycle, the process-wide in-flight table) <- ``protocol`` (:class:`TransferBackend`, :class:`PlanLike`,
  the plan checks) ; ``descriptors`` (raw batch validation, region lookup) <- ``registry`` (registration
  multiset, F21) and ``peers`` (metadata, connect-time layout check, F22) ; ``published`` (receiver halves
  published to senders, settled when the engine lets go of their memory) ; all <- ``base`` (:class:`BackendBase`)
  <- ``local`` / ``nixl`` / ``mooncake``; ``worker`` (a backend in a second process) uses only
  :func:`get_backend`. Backends know plans (by protocol) and regions, never allocators.
* Tests decide whether an engine may be skipped in one place, :func:`umalloc.testing.require_or_skip`.
"""

from __future__ import annotations

import importlib

from umalloc.backends.handle import HANDLE_STATES, TransferHandle
from umalloc.backends.protocol import PlanLike, TransferBackend
from umalloc.errors import BackendUnavailable, UmallocValueError

__all__ = [
    "BACKEND_NAMES",
    "HANDLE_STATES",
    "PlanLike",
    "TransferBackend",
    "TransferHandle",
    "available_backends",
    "backend_available",
    "get_backend",
]

#: Names accepted by :func:`get_backend`, in conformance-suite order.
BACKEND_NAMES: tuple[str, ...] = ("local", "nixl", "mooncake")

_MODULES = {
    "local": ("umalloc.backends.local", "LocalBackend"),
    "nixl": ("umalloc.backends.nixl", "NixlBackend"),
    "mooncake": ("umalloc.backends.mooncake", "MooncakeBackend"),
}

#: The Python module each engine needs (checked by :func:`backend_available`).
_ENGINE_MODULES = {"local": None, "nixl": "nixl_cu12", "mooncake": "mooncake.engine"}

def get_backend(name: str, **kw: object) -> TransferBackend:
    """Create a transfer backend by name, importing its engine only now.

    Args:
        name: one of :data:`BACKEND_NAMES` (``"local"``, ``"nixl"``, ``"mooncake"``).
        **kw: passed to the implementation's constructor (e.g. ``layout=PeerLayout``; see each class).

    Raises:
        UmallocValueError: unknown ``name``.
        BackendUnavailable: the engine cannot be imported or started here.

    >>> b = get_backend("local")
    >>> b.name, b.stats()["registered_regions"]
    ('local', 0)
    >>> b.close()
    """
    if name not in _MODULES:
        raise UmallocValueError(f"backend name={name!r}: allowed one of {BACKEND_NAMES}")
    mod_name, cls_name = _MODULES[name]
    try:
        mod = importlib.import_module(mod_name)
    except BackendUnavailable:
        raise
    except ImportError as e:  # pragma: no cover - the implementation modules wrap engine imports
        raise BackendUnavailable(f"backend {name!r} cannot be imported: {e}") from e
    return getattr(mod, cls_name)(**kw)


def backend_available(name: str) -> tuple[bool, str]:
    """``(True, "")`` if ``name``'s engine imports here, else ``(False, reason)``. Never raises for a known
    name; imports the engine module (once). O(1) after the first call.

    >>> backend_available("local")
    (True, '')
    """
    if name not in _MODULES:
        raise UmallocValueError(f"backend name={name!r}: allowed one of {BACKEND_NAMES}")
    try:
        importlib.import_module(_MODULES[name][0])
    except ImportError as e:  # BackendUnavailable is an ImportError
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def available_backends() -> list[str]:
    """The names of :data:`BACKEND_NAMES` whose engines import here, in order."""
    return [n for n in BACKEND_NAMES if backend_available(n)[0]]
