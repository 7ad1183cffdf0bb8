"""The typed exceptions of umalloc.

Three failure tiers (docs/architecture.md, "Failure tiers"):

* an expected shortage returns ``None`` (or ``False``) and changes nothing, never a partial allocation;
* caller misuse raises a :class:`UmallocValueError` subclass (also a :class:`ValueError`) naming the value
  and the allowed range, and changes nothing;
* a broken internal invariant raises :class:`InvariantError` naming the invariant. It is a
  :class:`UmallocError` (one base class catches every umalloc exception) and an :class:`AssertionError`; code
  that treats a ``UmallocError`` as a refused call catches ``InvariantError`` first and re-raises it.

Transfer-engine failures are :class:`BackendError` subclasses.
"""

from __future__ import annotations

from collections.abc import Sequence


class UmallocError(Exception):
    """Base class of every umalloc exception."""


class UmallocValueError(UmallocError, ValueError):
    """Caller misuse: a bad argument. Raised before any state changes."""


class SpecError(UmallocValueError):
    """An invalid geometry spec field.

    Attributes:
        field: dotted name of the offending field (``"ends[1].page_size"``).
        value: the value given.
        allowed: human-readable allowed range or set.
    """

    def __init__(self, field: str, value: object, allowed: str, detail: str = "") -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        msg = f"invalid {field}={value!r}: allowed {allowed}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class InvalidIdError(UmallocValueError):
    """An id (virtual/physical token or page) out of range, of the wrong dtype/shape, or otherwise unusable."""


class DoubleFreeError(InvalidIdError):
    """A page freed twice (or twice within one batch)."""


class NotAllocatedError(InvalidIdError):
    """A page freed, unbound or translated that was never allocated (or is not live now)."""


class TombstoneError(InvalidIdError):
    """Strict translation hit a tombstoned (unbound) table entry."""


class LeaseError(UmallocValueError):
    """Misuse of a lease: unknown pages, pinning a page that is not live, an already-released lease, ..."""


class InvariantError(UmallocError, AssertionError):
    """A broken internal invariant; the message names it. Always a bug in umalloc, never a refused call."""


class IncompatiblePeerError(UmallocValueError):
    """A peer whose geometry differs from ours, refused at connect time.

    Attributes:
        differences: one human-readable line per differing field.
    """

    def __init__(self, differences: Sequence[str]) -> None:
        self.differences = list(differences)
        lines = "\n  - ".join(self.differences)
        super().__init__(f"incompatible peer, {len(self.differences)} difference(s):\n  - {lines}")


class DescriptorBoundsError(UmallocValueError):
    """A transfer descriptor would touch bytes outside the registered regions or the leased pages."""


class BackendError(UmallocError):
    """A transfer backend failure."""


class BackendUnavailable(BackendError, ImportError):
    """The transfer engine cannot be imported or started on this machine."""


class RegistrationError(BackendError, ValueError):
    """Bad or unbalanced memory registration."""


class TransferError(BackendError):
    """A transfer failed (peer closed, engine error, unregistered destination, ...)."""


class TransferTimeout(TransferError, TimeoutError):
    """A transfer did not finish before its deadline."""


class HeapCopyError(UmallocError, TypeError):
    """An object owning raw addresses (the allocator's heap, the allocator) was copied, pickled or rebound."""


class ArenaInUseError(UmallocValueError):
    """A second allocator was built on an :class:`~umalloc.geometry.arena.Arena` that a live one manages."""


class StaleLeaseError(LeaseError):
    """An engine report (``unhold_engine``) or ``settle`` carried a lease generation that is no longer live (the
    lease was released, expired or settled and its pages may belong to a new owner since, F27), or asked for a transition the lease's state
    does not allow."""


class StaleHandleError(NotAllocatedError):
    """A request handle whose slot was freed (and perhaps reused) since the handle was issued: its generation is no
    longer the slot's (F30). Nothing changes."""


class ArenaMemoryError(UmallocError, MemoryError):
    """The host or device could not allocate an arena's bytes (nothing was allocated)."""


class WriteIncompleteError(UmallocValueError):
    """:meth:`umalloc.transfer.gate.WriteGate.post` with ``refuse=True`` before every producer of the plan's index
    vectors signalled that it wrote them (``missing``: vector name -> producers not yet signalled). Nothing was
    submitted or kept."""

    def __init__(self, message: str, missing: dict[str, tuple[str, ...]] | None = None) -> None:
        super().__init__(message)
        self.missing = dict(missing or {})


class PeerDiedError(TransferError):
    """The peer of a transfer (its process, agent or connection) is gone; what it may have written is in doubt."""
