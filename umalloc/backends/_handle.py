"""The transfer handle every backend returns from ``submit`` / ``write_descriptors``."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Handle states. ``pending`` until every engine part of the transfer has ended (F11); then ``done`` or
#: ``failed`` (engine error, dead peer, deadline, or released while pending).
HANDLE_STATES: tuple[str, ...] = ("pending", "done", "failed")


@dataclass(eq=False)
class TransferHandle:
    """One submitted transfer (one plan or one descriptor batch) to one peer.

    A handle may own several engine parts (Mooncake batches of at most 2048 descriptors, NIXL requests per
    memory kind); it is ``done`` only when every part is done, and ``failed`` only once every part has ended
    or the deadline passed (F11: every handle of a multi-part transfer).

    Attributes:
        handle_id: id unique within its backend.
        backend: the backend's name.
        peer: the peer name given to ``submit``.
        num_descriptors: descriptors posted (rows of the batch).
        total_bytes: sum of the descriptors' ``nbytes``.
        num_parts: engine requests/batches the transfer was split into.
        plan: the plan submitted, or ``None`` for a raw descriptor batch.
        state: ``"pending"``, ``"done"`` or ``"failed"``.
        error: the exception that failed the handle (a ``TransferError``), else ``None``.
        released: ``True`` once :meth:`TransferBackend.release` ran (idempotent).
        submitted_at / finished_at: ``time.monotonic()`` stamps (``finished_at`` ``None`` while pending).
    """

    handle_id: int
    backend: str
    peer: str
    num_descriptors: int
    total_bytes: int
    submitted_at: float
    plan: object | None = None
    num_parts: int = 0
    state: str = "pending"
    error: BaseException | None = None
    released: bool = False
    finished_at: float | None = None
    engine: dict = field(default_factory=dict, repr=False)

    @property
    def elapsed_s(self) -> float | None:
        """Seconds from submit to the terminal state, ``None`` while pending."""
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    @property
    def terminal(self) -> bool:
        return self.state != "pending"
