"""``mooncake``: WRITE transfers on a real Mooncake TransferEngine (TCP on CPU machines, P2P handshake).

Policy:

* One engine per backend: ``initialize(host, "P2PHANDSHAKE", protocol, "")`` — no metadata server; the peer is
  addressed as ``"<host>:<rpc port>"`` and its buffer addresses travel in umalloc's metadata. ``MC_LOG_LEVEL``
  defaults to ``ERROR``.
* ``connect`` probes the peer (``send_probe``), so a dead peer is refused at connect; the probe is bounded by
  ``connect_timeout_s`` (a peer process that does not answer holds the engine's probe for about a minute). The
  first transfer to a peer opens its segment, in the peer's sender thread (Note [Mooncake segment open]).
* Descriptors are posted in the chunks of Note [Bounded batches] (:mod:`umalloc.transfer.descriptors`): at most
  ``max_batch_descriptors`` (default 2048: the engine's default limit of queued transfers per peer; a larger
  batch, or two batches in flight together, fails) and ``max_batch_bytes`` (default 1 GiB) each — Note
  [Mooncake chunks].
* Every descriptor is posted as its own transfer id (``transfer_submit_write``) and polled with
  ``transfer_check_status`` until the engine reports it finished (COMPLETED or FAILED, which free the id) and never
  after: a second query of a freed id is a use-after-free that crashed the process when tried.
* Engine threads record results, and the sender thread lets go of the plan's engine hold once the engine
  reported every chunk of a handle finished (COMPLETED or FAILED, or skipped unposted), so an in-doubt lease settles
  without a poll (F24, F26); the handle and its plan finish in the caller's thread (``poll``/``wait``). The classic
  engine cannot cancel a posted transfer: only that terminal status, or ``close``, finishes a chunk.
* A plan's leases outlive every descriptor the engine was handed (Note [Mooncake deadlines]).

Note [Mooncake chunks]
~~~~~~~~~~~~~~~~~~~~~~
The per-peer limit counts every descriptor in flight to that peer, across batches and handles. So each peer gets
one sender thread that takes chunks in submit order: post a chunk, poll its ids until each finished (the calls
release the GIL), record the result, take the next. A chunk of a handle that already failed or was cancelled is
skipped (never posted), and so is a chunk whose plan's leases are no longer active or passed their deadline while it was queued.
When a chunk fails and the peer does not answer a probe, every later chunk to it fails without being posted (a
post to a dead peer costs about a second, so queued handles would otherwise fail one after another) until
``connect`` reaches it again. ``disconnect`` stops the peer's sender without waiting for a chunk the engine still
holds; a sender made by a later ``connect`` to the same peer posts nothing before its predecessor ended, so the
per-peer limit holds across reconnects.

Note [Mooncake segment open]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Opening a peer's segment is a handshake with the peer's process. ``get_first_buffer_address``, the engine's call
that opens a segment on its own, keeps the GIL while it waits: against a stopped peer it froze every Python
thread of the process for about 61 s (measured here with 0.3.13.post1: a ticker thread's longest gap was 61.7 s),
so no thread can bound it. ``transfer_submit_write`` opens the segment too and lets the GIL go while it waits
(the same stopped peer: the ticker's longest gap was 0.25 s, and the post returned once the peer resumed). So
``connect`` only probes, which also lets the GIL go, and the first post to the peer, in its sender thread, pays
the handshake; a caller's ``wait`` deadline bounds what it sees of that.

Note [Mooncake deadlines]
~~~~~~~~~~~~~~~~~~~~~~~~~
Mooncake cannot cancel a transfer it was handed, and its timeouts do not end one. In the engine's source,
``transfer_check_status`` answers TIMEOUT (-2) from a slice-age check while the slice is still in flight (the id
is kept), and the spinning ``get_batch_transfer_status`` frees the batch's ids at its own timeout
(``MC_TRANSFER_TIMEOUT`` plus one second per GiB) or at the first failed task while other slices are still moving.
Seen here (0.3.13, TCP, ``MC_TRANSFER_TIMEOUT=5``): descriptors to a paused peer stayed WAITING for 8 s, and every
byte landed when the peer resumed. None of this tells when the engine stopped reading the source pages or writing
the destination, so an engine timeout shorter than the lease deadline would prove nothing; umalloc takes the other
design (Note [Deadlines and in-flight parts] in :mod:`umalloc.backends.handle`):

* only COMPLETED (1) and FAILED (-1) finish a descriptor; TIMEOUT keeps it in flight and it is polled on; the
  spinning batch call is not used at all;
* a chunk is *in flight* from the moment the sender thread takes it (under the handle's lock, after checking
  that the handle is not cancelled or failed and that the plan's leases still hold) until every id it posted
  finished; ``_engine_in_flight`` counts such chunks;
* ``wait``'s deadline and ``forget`` mark the handle cancelled (its queued chunks are never posted) and fail
  it at once, but its plan — and so its leases — ends only when no chunk of it is in flight any more. A chunk
  stuck on a peer that never answers keeps its pages leased until the engine gives it up or the lease's own
  deadline (the allocator's F12 backstop) reclaims them.

Note [Mooncake retries]
~~~~~~~~~~~~~~~~~~~~~~~
The engine reports FAILED (-1) for a descriptor it gave up; on a loaded host that happens to a few descriptors of a
large chunk while the peer is fine (seen here: 63 of 2,048 descriptors of a multi-rank replay at load ~10, the
peer answering the probe right after). FAILED finishes the descriptor in the engine, and the plan's leases still pin
both sides' pages, so posting the same descriptor again writes the same source bytes to the same destination:
whatever part of the failed attempt landed is overwritten with identical bytes. So a chunk's failed descriptors
are posted again, up to ``max_retries`` times (default 2), only while (a) the peer answers a probe, (b) the handle
is neither cancelled nor failed, and (c) the plan's leases hold (checked under the handle's lock before each
retry); the chunk stays in flight throughout. A dead or closed peer, a withdrawn handle or a released lease fails the
chunk at once. :attr:`MooncakeBackend.retried_descriptors` counts the descriptors posted again.

Note [Mooncake status without spinning]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``get_batch_transfer_status`` waits by spinning on the batch's state, holding a core for the whole transfer; on a
small host that core is taken from the TCP threads of both ends. ``transfer_submit_write`` /
``transfer_check_status`` (one descriptor per id, non-blocking) let the sender thread sleep between rounds
instead. Measured here (two processes on a loaded 2-core host): 64 MiB in a few large descriptors moved about 2.1 GB/s
polled against 1.0-1.3 GB/s with the spinning batch call; 256 MiB as 2058 runs of 32 pages (4 KiB) moved
1.1-1.5 GB/s polled against 0.5-1.1 GB/s; page-sized descriptors move about 0.2 GB/s either way. Polling is
also the only way to learn when each descriptor finished (Note [Mooncake deadlines]), so every chunk is polled.

A round checks every id still pending, so the sleep between rounds grows with the time the chunk has been in
flight (at most 5 % of it, between 1 ms and 50 ms): a transfer that ends soon is seen soon, and a chunk stuck on
a peer that stopped answering (its handle draining, maybe for good) costs a few percent of a core instead of
about 40 % (2048 ids at a 1 ms cap, measured here).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from umalloc.backends.base import BackendBase
from umalloc.backends.handle import TransferHandle
from umalloc.backends.peers import PeerInfo
from umalloc.backends.protocol import plan_leases_gone
from umalloc.errors import (
    BackendError,
    BackendUnavailable,
    RegistrationError,
    TransferError,
    UmallocValueError,
)
from umalloc.geometry.region import DRAM, Region
from umalloc.transfer.descriptors import MAX_BATCH_BYTES, MAX_BATCH_DESCRIPTORS, Chunk

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
try:
    from mooncake import engine as _mc_engine
except (ImportError, OSError) as _e:  # pragma: no cover - depends on the install (libibverbs1 etc.)
    raise BackendUnavailable(
        "mooncake backend needs mooncake-transfer-engine(-non-cuda) and the system libraries libibverbs1, "
        f"libnl-3-200, libnl-route-3-200: {_e}") from _e

#: Sleep between status rounds of a chunk: doubles from 50 us up to ``POLL_NAP_SHARE`` of the time the chunk has
#: been in flight, at least ``POLL_MIN_CAP_S`` and at most ``POLL_MAX_NAP_S`` (Note [Mooncake status without
#: spinning]).
POLL_MIN_CAP_S = 1e-3
POLL_NAP_SHARE = 0.05
POLL_MAX_NAP_S = 0.05

#: ``_why``'s answer when the peer answers a probe after a failed chunk (the only case a chunk is retried).
PEER_REACHABLE = "peer reachable (it refused the write)"
#: Default ``max_retries`` (Note [Mooncake retries]).
MAX_RETRIES = 2

_STOP = object()
#: Result of a chunk the sender thread has taken and not finished: the engine may be touching its memory.
IN_FLIGHT = "in_flight"


def _let_go_if_finished(state: dict) -> None:
    """Once every chunk of a handle finished (none queued or taken), let go of the engine holds on its plan's leases
    from this sender thread: an in-doubt lease settles now, without waiting for the caller to poll (F24, F26).
    Chunks of a cancelled or failed handle count as finished once the sender skipped them. Handle lock held."""
    hold = state.get("hold")
    if hold is None or not hold.held:
        return
    if any(r is None or r is IN_FLIGHT for r in state["results"]):
        return
    hold.drop()



def _leases_gone(state: dict) -> str | None:
    """Why the handle's plan no longer protects its pages (:func:`plan_leases_gone`), or ``None``. Handle lock
    held."""
    try:
        return plan_leases_gone(state["plan"])
    except Exception as e:  # a lease that cannot be read cannot be trusted: do not post
        return f"the plan's leases could not be checked ({type(e).__name__}: {e})"


def _retry_stopper(state: dict) -> str | None:
    """Why a failed chunk of this handle must not be posted again (Note [Mooncake retries]), or ``None``. Takes the
    handle's lock."""
    with state["lock"]:
        if state["cancelled"] or state["failed"]:
            return "the handle was cancelled or failed"
        return _leases_gone(state)


@contextmanager
def _glog_errors_muted() -> Iterator[None]:
    """Raise glog's ``minloglevel`` to FATAL inside the engine's library for one call.

    ``TransferEngine.initialize(..., "P2PHANDSHAKE", ...)`` logs "Local segment descriptor not found" at ERROR
    level on every successful start; neither ``MC_LOG_LEVEL`` nor the ``GLOG_*`` environment variables reach
    the copy of glog linked into the engine, whose exported flag variable does. Where the symbol is missing
    (another build) nothing is muted.
    """
    try:
        flag = ctypes.c_int.in_dll(ctypes.CDLL(_mc_engine.__file__), "_ZN3fLI17FLAGS_minloglevelE")
    except (OSError, ValueError, AttributeError, NameError):
        yield
        return
    old, flag.value = flag.value, 3
    try:
        yield
    finally:
        flag.value = old

class _PeerSender:
    """One thread per peer posting chunks in order (Note [Mooncake chunks]).

    ``predecessor``: the thread of this peer's previous sender (stopped by ``disconnect`` while the engine may
    still hold one of its chunks); this one posts nothing before it ended, so the two never exceed the engine's
    per-peer limit together.
    """

    def __init__(self, engine: object, peer: str, predecessor: threading.Thread | None = None,
                 counts: dict[str, int] | None = None, max_retries: int = MAX_RETRIES) -> None:
        self.engine = engine
        self.peer = peer
        self.max_retries = max_retries
        #: Shared with the backend: ``status_checks`` (``transfer_check_status`` calls) and
        #: ``retried_descriptors`` (descriptors posted again, Note [Mooncake retries]); statistics.
        self.counts = counts if counts is not None else {"status_checks": 0, "retried_descriptors": 0}
        self.predecessor = predecessor
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        #: Why the peer is known unreachable (set by this thread when a failed chunk's probe fails, cleared by a
        #: successful ``connect``), else ``None``: later chunks then fail without being posted.
        self.unreachable: str | None = None
        self.thread = threading.Thread(target=self._run, name=f"umalloc-mooncake-{peer}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.predecessor is not None:
            self.predecessor.join()
            self.predecessor = None
        while True:
            job = self.jobs.get()
            if job is _STOP:
                return
            state, i, src, dst, lengths = job
            with state["lock"]:  # Note [Mooncake deadlines]: decide and claim under the handle's lock
                if state["cancelled"] or state["failed"]:
                    state["results"][i] = "skipped"
                    _let_go_if_finished(state)
                    continue
                why = _leases_gone(state)
                if why is None and self.unreachable is not None:
                    why = self.unreachable
                if why is not None:
                    state["results"][i] = TransferError(f"mooncake: {len(src)} descriptors to {self.peer!r} not "
                                                        f"posted: {why}")
                    state["failed"] = True
                    _let_go_if_finished(state)
                    continue
                state["results"][i] = IN_FLIGHT
            res = self._post(src, dst, lengths, functools.partial(_retry_stopper, state))
            with state["lock"]:
                state["results"][i] = res
                if res != "done":
                    state["failed"] = True
                _let_go_if_finished(state)

    def _post(self, src: list[int], dst: list[int], lengths: list[int],
              may_retry: Callable[[], str | None]) -> object:
        """Post a chunk and drain it (:meth:`_post_once`); descriptors the engine reported FAILED while the peer
        still answers a probe are posted again, up to ``max_retries`` times, while ``may_retry()`` says nothing
        stops it (``None``: the handle is neither cancelled nor failed and the plan's leases hold) — Note
        [Mooncake retries]. Returns ``"done"`` or the TransferError of the last attempt."""
        todo = list(zip(src, dst, lengths, strict=True))
        retries = 0
        while True:
            failed, status = self._post_once(todo)
            if not failed:
                return "done"
            why = self._why()
            if retries >= self.max_retries or why != PEER_REACHABLE or may_retry() is not None:
                after = f" after {retries} retries" if retries else ""
                return TransferError(f"mooncake: {len(failed)} of {len(todo)} descriptors to {self.peer!r} failed "
                                     f"(status {status}){after}; {why}")
            retries += 1
            self.counts["retried_descriptors"] += len(failed)
            todo = failed

    def _post_once(self, todo: list[tuple[int, int, int]]) -> tuple[list[tuple[int, int, int]], int]:
        """One transfer id per descriptor, each polled without spinning (sleeps between rounds) until the engine
        reports it finished, and never after: COMPLETED (1) and FAILED (-1) finish an id and free it; TIMEOUT (-2)
        does not (the slice is still in flight, Note [Mooncake deadlines]), nor does WAITING (0). Ids already
        posted are always drained, even after a failure, so no part of the chunk is still in flight when this
        returns (F11). Returns the descriptors that failed (a refused post also leaves the rest unposted: they
        count as failed) and the first failing status (-100: the engine refused the post)."""
        eng = self.engine
        pending: list[tuple[int, tuple[int, int, int]]] = []
        failed: list[tuple[int, int, int]] = []
        status = 0
        for k, (s, d, n) in enumerate(todo):
            try:
                bid = eng.transfer_submit_write(self.peer, s, d, n)
            except Exception:  # pragma: no cover - the engine returns codes; nothing was posted for this one
                bid = None
            if bid is None or bid <= 0:
                failed.extend(todo[k:])
                status = -100
                break
            pending.append((bid, (s, d, n)))
        nap = 5e-5
        t0 = time.monotonic()
        while pending:
            keep = []
            self.counts["status_checks"] += len(pending)
            for bid, desc in pending:
                st = eng.transfer_check_status(bid)
                if st == 1:
                    continue
                if st == -1:
                    failed.append(desc)
                    status = status or st
                else:  # 0 (waiting) or -2 (TIMEOUT: older than MC_TRANSFER_TIMEOUT, still in flight)
                    keep.append((bid, desc))
            pending = keep
            if pending:
                time.sleep(nap)
                # Note [Mooncake status without spinning]: the rounds cost a bounded share of the time in flight
                cap = min(POLL_MAX_NAP_S, max(POLL_MIN_CAP_S, (time.monotonic() - t0) * POLL_NAP_SHARE))
                nap = min(nap * 2, cap)
        return failed, status

    def _why(self) -> str:
        """Probe the peer after a failed chunk. An unreachable peer fails every later chunk without posting it
        (each post to a dead peer costs about a second in the engine, so queued handles would fail one by one)."""
        probe = getattr(self.engine, "send_probe", None)
        if probe is None:  # pragma: no cover - older engines
            return "peer state unknown"
        rc = probe(self.peer)
        if rc == 0:
            return PEER_REACHABLE
        self.unreachable = f"peer closed or unreachable (probe {rc})"
        return self.unreachable

    def stop(self) -> None:
        """Ask the thread to end once it finished the chunk it is working on (queued chunks of cancelled or failed
        handles are skipped, never posted). Does not wait."""
        self.jobs.put(_STOP)


class MooncakeBackend(BackendBase):
    """Transfer backend on a Mooncake TransferEngine.

    Args:
        layout: this side's ``PeerLayout`` (see :class:`~umalloc.backends.base.BackendBase`).
        host: address the engine binds to (``127.0.0.1``).
        protocol: ``"tcp"`` (CPU machines) or ``"rdma"``.
        max_batch_descriptors: most descriptors per chunk (1..2048 unless the engine's per-peer limits were raised
            through ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` before the engine started).
        max_batch_bytes: most bytes per chunk (default 1 GiB; Note [Bounded batches] in
            :mod:`umalloc.transfer.descriptors`).
        close_timeout_s: how long :meth:`close` / ``reset`` wait, in all, for the engine to finish the chunks it
            is working on (Note [Mooncake deadlines]); ``disconnect`` never waits for them.
        connect_timeout_s: bound on :meth:`connect`'s probe of the peer (the engine's own probe of a peer process
            that does not answer blocks for about a minute).
        max_retries: how many times a chunk's FAILED descriptors are posted again while the peer answers a probe
            and the plan's leases hold (Note [Mooncake retries]); 0 turns retries off.

    Raises:
        UmallocValueError: a bad ``max_batch_descriptors``, ``max_batch_bytes``, timeout or ``max_retries``
            (before the engine starts).
        BackendUnavailable: the engine does not initialise.
    """

    name = "mooncake"
    fences_peer_writes = True  # the receiving engine serves writes into its registered buffers only (observed)

    def __init__(self, *, layout: object | None = None, host: str = "127.0.0.1", protocol: str = "tcp",
                 max_batch_descriptors: int = MAX_BATCH_DESCRIPTORS, max_batch_bytes: int = MAX_BATCH_BYTES,
                 close_timeout_s: float = 5.0, connect_timeout_s: float = 10.0,
                 max_retries: int = MAX_RETRIES) -> None:
        for what, v in (("close_timeout_s", close_timeout_s), ("connect_timeout_s", connect_timeout_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
                raise UmallocValueError(f"{what}={v!r}: allowed a positive finite number of seconds")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or not 0 <= max_retries <= 100:
            raise UmallocValueError(f"max_retries={max_retries!r}: allowed an int in [0, 100]")
        self.max_retries = max_retries
        super().__init__(layout=layout, host=host, max_batch_descriptors=max_batch_descriptors,
                         max_batch_bytes=max_batch_bytes)
        self.close_timeout_s = float(close_timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self._engine = _mc_engine.TransferEngine()
        with _glog_errors_muted():
            rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            self._closed = True
            raise BackendUnavailable(f"mooncake engine initialize({host!r}, P2PHANDSHAKE, {protocol!r}) -> {rc}")
        self.rpc_port = int(self._engine.get_rpc_port())
        self.session = f"{host}:{self.rpc_port}"
        self._senders: dict[str, _PeerSender] = {}
        #: Threads of senders stopped by ``disconnect`` (maybe still finishing a chunk), by peer session: the
        #: peer's next sender waits for its predecessor.
        self._retired: dict[str, threading.Thread] = {}
        self._sender_counts = {"status_checks": 0, "retried_descriptors": 0}

    @property
    def status_checks(self) -> int:
        """``transfer_check_status`` calls the sender threads made so far (Note [Mooncake status without
        spinning]); a statistic, not reset by :meth:`reset`."""
        return int(self._sender_counts["status_checks"])

    @property
    def retried_descriptors(self) -> int:
        """Descriptors posted again after the engine reported them FAILED (Note [Mooncake retries]); a statistic,
        not reset by :meth:`reset`."""
        return int(self._sender_counts["retried_descriptors"])

    # ---- registration ----------------------------------------------------------------------------------
    def _check_region(self, region: Region) -> None:
        if region.mem_kind != DRAM and not getattr(_mc_engine, "SUPPORT_CUDA", False):
            raise RegistrationError(f"mooncake (non-CUDA build) registers host memory only: {region}")

    def _engine_register(self, region: Region) -> object:
        rc = self._engine.register_memory(region.base_ptr, region.nbytes)
        if rc != 0:
            raise RegistrationError(f"mooncake register_memory({region}) -> {rc}")
        return None

    def _engine_deregister(self, region: Region, token: object) -> None:
        rc = self._engine.unregister_memory(region.base_ptr)
        if rc != 0:
            raise RegistrationError(f"mooncake unregister_memory({region}) -> {rc}")

    # ---- metadata and peers ----------------------------------------------------------------------------
    def _engine_metadata(self) -> dict:
        return {"session": self.session, "rpc_port": self.rpc_port}

    def _check_engine_metadata(self, engine: dict) -> None:
        session = engine.get("session")
        if not isinstance(session, str) or not session:
            raise UmallocValueError(f"mooncake peer metadata: engine.session={session!r}, allowed a non-empty "
                                    "'host:rpc_port' str")

    def _engine_connect(self, md: dict) -> str:
        session = md["engine"]["session"]  # checked by _check_engine_metadata
        self._reach(session)
        if session not in self._senders:
            self._senders[session] = _PeerSender(self._engine, session, self._retired.pop(session, None),
                                                 self._sender_counts, self.max_retries)
        self._senders[session].unreachable = None  # it answered the probe above
        return session

    def _reach(self, session: str) -> None:
        """Probe the peer (``send_probe``), bounded by ``connect_timeout_s``.

        The probe blocks (without the GIL) until the peer answers; a peer process that does not answer
        (stopped, overloaded) holds it for about a minute. So it runs in a helper thread, and ``connect`` gives
        up at the bound; the helper ends when the engine does. The peer's segment is not opened here (Note
        [Mooncake segment open]).

        Raises:
            BackendError: the probe failed, or the peer did not answer within ``connect_timeout_s``.
        """
        eng = self._engine
        out: dict[str, object] = {}

        def run() -> None:
            try:
                probe = getattr(eng, "send_probe", None)
                out["probe"] = 0 if probe is None else probe(session)
            except Exception as e:  # pragma: no cover - the engine returns codes
                out["error"] = e
            out["done"] = True

        t = threading.Thread(target=run, name=f"umalloc-mooncake-connect-{session}", daemon=True)
        t.start()
        t.join(self.connect_timeout_s)
        if not out.get("done"):
            raise BackendError(f"mooncake: peer {session!r} did not answer the probe/handshake within "
                               f"{self.connect_timeout_s:.3g} s (is its process running?)")
        if "error" in out:  # pragma: no cover
            raise BackendError(f"mooncake: connecting to {session!r} failed: {out['error']}") from out["error"]
        if out["probe"] != 0:
            raise BackendError(f"mooncake: peer {session!r} unreachable (probe -> {out['probe']})")

    def _engine_peer_alive(self, peer: PeerInfo) -> bool:
        """The peer answers ``send_probe`` within 1 s (Mooncake's connection state; a stopped process that does
        not answer counts as down)."""
        eng = self._engine
        probe = getattr(eng, "send_probe", None)
        if probe is None:  # pragma: no cover - older engines
            return True
        out: dict[str, int] = {}
        t = threading.Thread(target=lambda: out.setdefault("rc", probe(peer.name)), daemon=True,
                             name=f"umalloc-mooncake-probe-{peer.name}")
        t.start()
        t.join(1.0)
        return out.get("rc") == 0

    def _engine_disconnect(self, peer: PeerInfo) -> None:
        """Stop the peer's sender without waiting: a chunk the engine still holds (a draining handle) finishes in the
        background, and a later sender to the same peer starts posting only after it (Note [Mooncake chunks])."""
        self._retired = {k: t for k, t in self._retired.items() if t.is_alive()}
        sender = self._senders.pop(peer.name, None)
        if sender is not None:
            sender.stop()
            self._retired[peer.name] = sender.thread

    # ---- transfers -------------------------------------------------------------------------------------
    def _engine_post(self, h: TransferHandle, chunks: list[Chunk], peer: PeerInfo, item_bytes: int | None) -> None:
        """Queue every chunk on the peer's sender, in order (Note [Mooncake chunks]); one part per chunk."""
        sender = self._senders.get(peer.name)
        if sender is None or not sender.thread.is_alive():
            raise TransferError(f"mooncake: no sender for peer {peer.name!r}")
        state = {"lock": threading.Lock(), "results": [None] * len(chunks), "cancelled": False, "failed": False,
                 "plan": h.plan, "hold": h.engine.get("hold")}
        h.engine["state"] = state
        h.num_parts = len(chunks)
        for k, (c, _, _) in enumerate(chunks):
            sender.jobs.put((state, k, c[:, 0].tolist(), c[:, 1].tolist(), c[:, 2].tolist()))

    def _engine_poll(self, h: TransferHandle) -> tuple[int, BaseException | None]:
        state = h.engine.get("state")
        if state is None:
            return 0, None
        pending = 0
        err = None
        with state["lock"]:
            for res in state["results"]:
                if res is None or res is IN_FLIGHT:
                    pending += 1
                elif isinstance(res, BaseException) and err is None:
                    err = res
                elif res == "skipped" and err is None:
                    err = TransferError("mooncake: a chunk was withdrawn before it was posted (the handle was "
                                        "cancelled or timed out): not every byte was sent")
        return pending, err

    def _engine_withdraw(self, h: TransferHandle) -> None:
        self._engine_cancel(h)  # only queued chunks are withdrawn: a chunk the engine holds runs to its end

    def _engine_cancel(self, h: TransferHandle) -> None:
        state = h.engine.get("state")
        if state is not None:
            with state["lock"]:
                state["cancelled"] = True  # queued chunks are skipped from now on, never posted

    def _engine_in_flight(self, h: TransferHandle) -> int:
        """Chunks the sender thread has taken and not finished, plus queued chunks that may still be taken
        (none once the handle is cancelled or failed). Note [Mooncake deadlines]."""
        state = h.engine.get("state")
        if state is None:
            return 0
        with state["lock"]:
            results = state["results"]
            taken = sum(1 for r in results if r is IN_FLIGHT)
            if state["cancelled"] or state["failed"]:
                return taken
            return taken + sum(1 for r in results if r is None)

    def _chunks_in_flight(self) -> int:
        return sum(self._engine_in_flight(h) for h in self._ht.draining.values())

    def _engine_quiesce(self) -> None:
        """Wait, at most ``close_timeout_s`` in all, until no chunk of a draining handle is in the engine any
        more. Sender threads keep running (a refused ``reset`` keeps its peers usable)."""
        deadline = time.monotonic() + self.close_timeout_s
        nap = 1e-4
        while self._chunks_in_flight():
            now = time.monotonic()
            if now >= deadline:
                return
            time.sleep(min(nap, deadline - now))
            nap = min(nap * 2, 5e-3)

    def _engine_close(self) -> None:
        """Stop every sender and wait, at most ``close_timeout_s`` in all, for the threads to end — not at all
        while the engine still holds a chunk (``close`` already waited for it in ``_engine_quiesce``): such a
        thread ends, and drops the engine, when the engine lets go of the chunk."""
        threads = list(self._retired.values())
        for sender in self._senders.values():
            sender.stop()
            threads.append(sender.thread)
        self._senders.clear()
        self._retired.clear()
        if not self._chunks_in_flight():
            deadline = time.monotonic() + self.close_timeout_s
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
        self._engine = None  # the engine shuts down once no sender or connect thread still holds it
