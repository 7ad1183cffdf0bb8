"""The transfer handle every backend returns from ``submit`` / ``write_descriptors``."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Handle states. ``pending`` until every engine part of the transfer has ended (F11); then ``done`` or
#: ``failed`` (engine error, dead peer, deadline, or released while pending). A handle failed by a deadline or a
#: release may still be ``draining``: the engine has not confirmed that its parts stopped touching memory, so its
#: plan (and leases) has not ended yet (Note [Deadlines and in-flight parts] in ``umalloc.backends._base``).
HANDLE_STATES: tuple[str, ...] = ("pending", "done", "failed")


@dataclass(eq=False)
class TransferHandle:
    """One submitted transfer (one plan or one descriptor batch) to one peer.

    A handle may own several engine parts (Mooncake batches of at most 2048 descriptors, NIXL requests per
    memory kind); it is ``done`` only when every part is done, and ``failed`` once a part failed and every part
    has ended, or when ``wait``'s deadline passed or it was released while pending. In the last two cases parts
    already handed to the engine may still be moving bytes: the handle is then ``draining`` and its plan ends
    (releasing its leases) only when the engine confirms that every part ended (F11: every handle of a
    multi-part transfer; Note [Deadlines and in-flight parts]).

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
        draining: ``True`` while the handle is failed but the engine may still read or write its memory; the
            plan's leases are held until it turns ``False`` (``poll`` / ``progress`` / ``drain`` observe it).
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
    draining: bool = False
    finished_at: float | None = None
    engine: dict = field(default_factory=dict, repr=False)

    @property
    def elapsed_s(self) -> float | None:
        """Seconds from submit to the terminal state, ``None`` while pending."""
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    @property
    def terminal(self) -> bool:
        return self.state != "pending"
