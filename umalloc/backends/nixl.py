"""``nixl``: WRITE transfers on a real NIXL agent (UCX backend; DRAM regions on CPU machines, VRAM on GPUs).

Policy:

* One agent per backend, named ``umalloc-<peer id>``, created with the progress thread OFF (on small hosts the
  thread spins most of a core) and the listener thread off: metadata travels in umalloc's own metadata bytes
  (``get_agent_metadata`` -> ``add_remote_agent``). Without a progress thread a target only advances when it is
  progressed, so :meth:`progress` drains notifications (``get_new_notifs``) of every live agent of this
  process, ``wait`` progresses while it polls, and a receiver in another process keeps calling
  :meth:`progress` (``needs_progress`` is True; the worker harness in :mod:`umalloc.backends.worker` does it).
* ``UCX_NET_DEVICES`` defaults to ``lo`` (loopback) before the first agent starts, and then ``UCX_MODULES`` to
  ``^ib,rdmacm`` (Note [UCX modules on loopback]); both are left alone when already set.
* Posting: one request per chunk of Note [Bounded batches] (:mod:`umalloc.transfer.descriptors`) and (source
  kind/device, destination kind/device) group, usually one group. Two ways, chosen per request
  by ``mode``: ``"oneshot"`` builds transfer lists from the descriptors (``initialize_xfer``); ``"prepped"``
  prepares per-page lists of both regions once per ``(peer, regions, item_bytes)`` (``prep_xfer_dlist``) and
  posts page indices (``make_prepped_xfer``); NIXL merges index runs that are contiguous on both sides.
  ``"auto"`` (default) follows the measured rule of Note [NIXL post mode].
* Peers shake hands over NIXL notifications (Note [NIXL peer handshake]): ``connect`` is refused unless the
  peer answers within ``connect_timeout_s``, and a peer that closes cleanly tells its senders, whose later or
  pending transfers to it then fail instead of writing into memory it no longer owns.
* Engine errors (``nixlRemoteDisconnectError`` from a dead peer, ``ERR`` states, refused requests) fail the
  handle with :class:`~umalloc.errors.TransferError`; cancelling releases the request (NIXL aborts it) and keeps
  a request that cannot be released yet for a later retry, so the agent never leaks it.
* A request NIXL refused to release is still active: its handle stays ``draining`` and its plan keeps its
  leases until a retried release succeeds (Note [NIXL cancel and leases]).

Note [UCX modules on loopback]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``UCX_NET_DEVICES=lo`` nothing needs UCX's InfiniBand modules, and on this machine class loading them makes
the process crash at exit (SIGSEGV in the bundled ``libnl-route``'s library destructor once a UCX agent has
existed, so a test run that passed still exits 139). So when the devices are loopback and ``UCX_MODULES`` is unset,
the module sets ``UCX_MODULES=^ib,rdmacm`` before any agent starts; set ``UCX_MODULES`` (and
``UCX_NET_DEVICES``) yourself to use RDMA.

Note [NIXL peer handshake]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A UCX WRITE over shared memory (CMA) lands in the target process without the target agent taking part, so a
target whose agent was closed while its process lives would still be written into, and NIXL reports DONE (seen
here). umalloc therefore adds a small handshake on NIXL's own notification channel:

* ``connect`` sends ``umalloc:hello:<own agent metadata>``; the target loads it, remembers the sender and answers
  ``umalloc:ack``; ``connect`` progresses until the ack arrives or raises :class:`~umalloc.errors.BackendError`
  at ``connect_timeout_s``. (The first WRITE of a connection still needs the target to progress: UCX finishes
  wiring its RMA lanes then; later WRITEs over CMA complete without the target.)
* ``close`` sends ``umalloc:bye`` to every sender that said hello and progresses briefly to flush it; a sender that
  sees the bye fails pending transfers to that peer and refuses new ones with
  :class:`~umalloc.errors.TransferError`. ``disconnect`` / ``close`` on the sender send ``umalloc:forget`` so the
  target drops the sender.
* A target that dies without a bye is caught by UCX (``NIXL_ERR_REMOTE_DISCONNECT``), and within one process the
  peer's open/closed state is read directly.

Note [NIXL registration generations]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A target's metadata carries its registration generation (``reg_gen``: 1, + 1 at every deregistration). A sender's
hello quotes the generation of the metadata it connects with; a target at another generation answers
``umalloc:stale:<now>`` instead of the ack, and ``connect`` raises :class:`~umalloc.errors.RegistrationError`
(F30: old metadata names memory deregistered since; a WRITE through it would land there and report DONE). A
target that deregisters tells its senders ``umalloc:regen:<now>``, and every post checks the generation (within
one process, the target's own counter): a post to a target past the connect's generation is refused before
anything is sent.

Notifications are drained with ``get_new_notifs`` (``update_notifs`` keeps every message forever).

Note [NIXL cancel and leases]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At ``wait``'s deadline nothing is released: a request stalled on a receiver that has not progressed yet is
released by NIXL without complaint, yet once the receiver progresses the bytes still arrive (seen here: the plan
reported failed, its pages free, while the WRITE landed). So the handle is ``in_doubt``, its request stays in
NIXL and is read (``check_xfer_state``) until it reports DONE or ERR; the plan then finishes with that outcome.
On a release, a pending request is released: NIXL checks it once more and, if it is
still in progress, asks the UCX backend to cancel it; a release that succeeds means NIXL no longer runs the
request. A release that fails (``NIXL_ERR_REPOST_ACTIVE``: the request is still active) leaves a *zombie*,
retried on every :meth:`~umalloc.backends.base.BackendBase.progress`; the zombie counts as in flight
(``_engine_in_flight``), so its handle drains and its plan finishes only once the retried release succeeds (Note
[Deadlines and in-flight parts] in :mod:`umalloc.backends.handle`). Closing the backend ends the agent and with it
every zombie. What UCX had already put on the wire before the cancel is beyond any sender's reach; a receiver
keeps its half leased until the sender reports its plan finished.

Note [NIXL post mode]
~~~~~~~~~~~~~~~~~~~~~
Measured on this machine class (benchmarks/bench_backends.py, 256 MiB between two processes, UCX over CMA;
memcpy 9.4 GB/s, the kernel's process_vm_writev 4.3 GB/s): one-shot lists of coalesced runs move about 5 GB/s
whatever the page size; per-page descriptors posted one-shot drop to 1.3-1.9 GB/s at 4 KiB (every post rebuilds and
checks N descriptors), while prepared per-page lists reach 4.3-4.8 GB/s on contiguous and replay-shaped layouts
(NIXL merges index runs contiguous on both sides) and 5.2-5.5 GB/s at 64 KiB. ``auto`` therefore posts prepared
lists when the caller supplies ``item_bytes`` and the batch averages at most ``PREP_MAX_PAGES_PER_DESC`` pages
per descriptor (per-page batches), and one-shot lists otherwise (coalesced runs, plans mixing page sizes).
"""

from __future__ import annotations

import base64
import ctypes
import functools
import glob
import logging
import os
import re
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from umalloc.backends.base import BackendBase
from umalloc.backends.handle import TransferHandle
from umalloc.backends.peers import PeerInfo
from umalloc.errors import (
    BackendError,
    BackendUnavailable,
    RegistrationError,
    TransferError,
    UmallocValueError,
)
from umalloc.geometry.region import Region
from umalloc.transfer.descriptors import MAX_BATCH_BYTES, MAX_BATCH_DESCRIPTORS, Chunk

os.environ.setdefault("UCX_NET_DEVICES", "lo")
if os.environ["UCX_NET_DEVICES"] == "lo" and "UCX_MODULES" not in os.environ:
    os.environ["UCX_MODULES"] = "^ib,rdmacm"  # Note [UCX modules on loopback]
try:
    import nixl_cu12 as _nixl
except ImportError as _e:  # pragma: no cover - depends on the install
    raise BackendUnavailable(f"nixl backend needs the nixl-cu12 package (module nixl_cu12): {_e}") from _e

if not os.environ.get("NIXL_LOG_LEVEL"):
    logging.getLogger("nixl").setLevel(logging.WARNING)

MODES = ("auto", "oneshot", "prepped")
HELLO = b"umalloc:hello:"
ACK = b"umalloc:ack"
BYE = b"umalloc:bye"
FORGET = b"umalloc:forget"
STALE = b"umalloc:stale:"   # the target's answer to a hello carrying an old registration generation
REGEN = b"umalloc:regen:"   # the target tells its senders its registration generation moved
#: Live NIXL backends of this process by agent name (peers in one process read each other's state).
_AGENTS: weakref.WeakValueDictionary[str, NixlBackend] = weakref.WeakValueDictionary()
#: ``auto`` posts prepared per-page lists when descriptors average at most this many pages.
PREP_MAX_PAGES_PER_DESC = 1.5


# Note [Goodbyes to a gone peer]
# A goodbye (BYE, FORGET), or a target's answer to a sender (ACK, STALE, REGEN), to a peer whose process already
# ended (a prefill process killed right after its hello) fails inside NIXL, which logs the failure
# (``genNotif ... NIXL_ERR_REMOTE_DISCONNECT``) on stderr before umalloc sees the error it expects and ignores.
# So a target takes in pending forgets before it says goodbye (a sender that disconnected gets none), and every
# such message is sent with the abseil log level NIXL's library writes with raised to FATAL for that call; where the
# library or its symbols are not found (another build) nothing is muted.
@functools.cache
def _absl_log_level() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """``(get, set)`` of the minimum log level of the abseil copy bundled with ``nixl_cu12``, or None."""
    try:
        libdir = os.path.join(os.path.dirname(os.path.dirname(_nixl.__file__)), "nixl_cu12.libs")
        path = sorted(glob.glob(os.path.join(libdir, "libabsl_log_globals-*.so*")))[0]
        with open(path, "rb") as f:
            names = f.read()
        get_name = re.search(rb"_ZN4absl12lts_\d+11MinLogLevelEv", names)
        set_name = re.search(rb"_ZN4absl12lts_\d+14SetMinLogLevelENS0_18LogSeverityAtLeastE", names)
        if get_name is None or set_name is None:
            return None
        lib = ctypes.CDLL(path)
        get, put = getattr(lib, get_name[0].decode()), getattr(lib, set_name[0].decode())
    except (OSError, IndexError, AttributeError, TypeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, []
    put.restype, put.argtypes = None, [ctypes.c_int]
    return get, put


@contextmanager
def _engine_errors_muted() -> Iterator[None]:
    """Note [Goodbyes to a gone peer]: NIXL logs nothing below FATAL inside the block (process-wide while it
    runs: keep the block to one expected-to-fail call)."""
    calls = _absl_log_level()
    if calls is None:
        yield
        return
    get, put = calls
    old = get()
    put(3)  # absl::LogSeverityAtLeast::kFatal
    try:
        yield
    finally:
        put(old)


def _dev_id(region: Region) -> int:
    dev = region.device
    return int(dev.split(":", 1)[1]) if ":" in dev else 0


class NixlBackend(BackendBase):
    """Transfer backend on a NIXL agent.

    Args:
        layout: this side's ``PeerLayout`` (see :class:`~umalloc.backends.base.BackendBase`).
        mode: ``"auto"``, ``"oneshot"`` or ``"prepped"`` (Note [NIXL post mode]).
        agent_name: NIXL agent name (default ``umalloc-<peer id>``; must be unique among connected agents).
        connect_timeout_s: bound on :meth:`connect`'s handshake (seconds).
        max_batch_descriptors, max_batch_bytes: most descriptors and bytes per request (defaults 2048 and 1 GiB;
            Note [Bounded batches] in :mod:`umalloc.transfer.descriptors`).

    Raises:
        UmallocValueError: a bad ``mode`` or batch cap (before the agent starts).
        BackendUnavailable: no UCX plugin, or the agent cannot start.
    """

    name = "nixl"
    needs_progress = True

    def __init__(self, *, layout: object | None = None, host: str = "127.0.0.1", mode: str = "auto",
                 agent_name: str | None = None, connect_timeout_s: float = 10.0,
                 max_batch_descriptors: int = MAX_BATCH_DESCRIPTORS, max_batch_bytes: int = MAX_BATCH_BYTES) -> None:
        if mode not in MODES:
            raise UmallocValueError(f"mode={mode!r}: allowed one of {MODES}")
        super().__init__(layout=layout, host=host, max_batch_descriptors=max_batch_descriptors,
                         max_batch_bytes=max_batch_bytes)
        self.mode = mode
        self.connect_timeout_s = float(connect_timeout_s)
        self.agent_name = agent_name or f"umalloc-{self._peer_id[:16]}"
        try:
            conf = _nixl.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
            self._agent = _nixl.nixl_agent(self.agent_name, conf)
        except Exception as e:
            self._closed = True
            raise BackendUnavailable(f"nixl agent could not start: {e}") from e
        if "UCX" not in self._agent.backends:
            self._closed = True
            raise BackendUnavailable(f"nixl: UCX plugin not available (plugins: {self._agent.get_plugin_list()})")
        self._prepped: dict[tuple, tuple] = {}
        self._zombies: list[dict] = []  # parts whose request NIXL refused to release: retried (Note [NIXL cancel ...])
        self._senders: set[str] = set()  # agents that said hello to us (we are their target)
        self._acked: set[str] = set()  # targets that answered our hello
        self._gone: set[str] = set()  # targets that said bye
        # Note [NIXL registration generations]: this side's generation (+ 1 at every deregistration), the
        # generation each target's metadata carried at connect, and targets known to have moved past it
        self._reg_gen = 1
        self._peer_gen: dict[str, int] = {}
        self._stale: dict[str, int] = {}
        self._loaded_stale: set[str] = set()   # senders loaded only to answer a stale hello
        _AGENTS[self.agent_name] = self

    # ---- registration ----------------------------------------------------------------------------------
    def _engine_register(self, region: Region) -> object:
        return self._agent.register_memory([(region.base_ptr, region.nbytes, _dev_id(region), "")],
                                           mem_type=region.mem_kind, backends=["UCX"])

    def deregister(self, regions: Sequence[Region]) -> None:
        """As :meth:`BackendBase.deregister`, refused while a sender that said hello is still connected (F25): a
        UCX WRITE over shared memory lands in memory the target deregistered and NIXL reports it DONE (seen
        here), so a connected sender could write into memory its owner reused. Senders disconnect first (their
        ``disconnect``/``close`` sends the forget this side waits for), or this side closes (its goodbye fails
        their transfers).

        Raises:
            RegistrationError: a sender is connected (named), or as :meth:`BackendBase.deregister`.
        """
        self._check_open()
        self._engine_progress()  # take in pending forgets
        if self._senders:
            raise RegistrationError(f"nixl: deregister refused: sender(s) {sorted(self._senders)} are connected "
                                    "and may still write this memory (F25); they must disconnect first")
        super().deregister(regions)

    def _engine_deregister(self, region: Region, token: object) -> None:
        self._agent.deregister_memory(token, backends=["UCX"])
        self._reg_gen += 1   # metadata taken before now names memory that may be gone
        for sender in sorted(self._senders):
            try:
                with _engine_errors_muted():  # Note [Goodbyes to a gone peer]
                    self._agent.send_notif(sender, REGEN + str(self._reg_gen).encode())
            except Exception:  # pragma: no cover - a sender already gone needs no notice
                pass

    def _on_registration_change(self) -> None:
        self._drop_prepped(lambda key: True)

    def _drop_prepped(self, pred) -> None:
        for key in [k for k in self._prepped if pred(k)]:
            for dl in self._prepped.pop(key):
                try:
                    dl.release()
                except Exception:  # pragma: no cover - best effort
                    pass

    # ---- metadata and peers ----------------------------------------------------------------------------
    def _engine_metadata(self) -> dict:
        md = self._agent.get_agent_metadata()
        return {"agent_name": self.agent_name, "agent_md": base64.b64encode(md).decode(), "reg_gen": self._reg_gen}

    def _check_engine_metadata(self, engine: dict) -> None:
        name, md = engine.get("agent_name"), engine.get("agent_md")
        if not isinstance(name, str) or not name:
            raise UmallocValueError(f"nixl peer metadata: engine.agent_name={name!r}, allowed a non-empty str")
        try:
            ok = isinstance(md, str) and bool(base64.b64decode(md, validate=True))
        except ValueError:  # binascii.Error
            ok = False
        if not ok:
            raise UmallocValueError("nixl peer metadata: engine.agent_md allowed the base64 of NIXL agent metadata")
        gen = engine.get("reg_gen")
        if isinstance(gen, bool) or not isinstance(gen, int) or gen < 1:
            raise UmallocValueError(f"nixl peer metadata: engine.reg_gen={gen!r}, allowed an int >= 1 (the "
                                    f"registration generation)")

    def _engine_connect(self, md: dict) -> str:
        eng = md["engine"]  # checked by _check_engine_metadata
        want = eng["agent_name"]
        if want in self._peers:
            self._engine_disconnect(self._peers[want])
        elif want in self._senders:  # loaded when it said hello to us: reload its current metadata
            try:
                self._agent.remove_remote_agent(want)
            except Exception:  # pragma: no cover
                pass
        try:
            name = self._agent.add_remote_agent(base64.b64decode(eng["agent_md"]))
        except Exception as e:
            raise BackendError(f"nixl: add_remote_agent failed: {e}") from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != want:
            raise BackendError(f"nixl: metadata names agent {want!r} but NIXL loaded {name!r}")
        self._acked.discard(name)
        self._gone.discard(name)
        self._stale.pop(name, None)
        gen = int(eng["reg_gen"])
        try:
            self._agent.send_notif(name, HELLO + str(gen).encode() + b":" + self._agent.get_agent_metadata())
            deadline = time.monotonic() + self.connect_timeout_s
            while name not in self._acked:
                if name in self._stale:
                    raise RegistrationError(
                        f"nixl: the metadata of peer {name!r} is stale: it carries registration generation {gen}, "
                        f"the peer is at {self._stale.pop(name)} (it deregistered memory since); allowed the "
                        f"peer's current metadata")
                if time.monotonic() >= deadline:
                    raise BackendError(f"nixl: peer {name!r} did not answer the handshake within "
                                       f"{self.connect_timeout_s:.3g} s (is it progressing?)")
                self.progress()
                time.sleep(0.0001)
        except BaseException:
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # pragma: no cover
                pass
            raise
        self._peer_gen[name] = gen
        return name

    def _engine_check_peer_metadata(self, peer: PeerInfo) -> None:
        """Note [NIXL registration generations]: refuse a post to a target whose registrations moved past the
        generation its metadata carried (its notice, or within this process its own counter)."""
        self._engine_progress()
        if self._peer_closed(peer.name):
            return   # a closed target fails the handle as a closed peer (its engine writes nothing more)
        want = self._peer_gen.get(peer.name)
        other = _AGENTS.get(peer.name)
        now = self._stale.get(peer.name)
        if now is None and other is not None and peer.pid == os.getpid() and want is not None \
                and other._reg_gen != want:
            now = other._reg_gen
        if now is not None and now != want:
            raise RegistrationError(f"nixl: peer {peer.name!r} deregistered memory since its metadata was taken "
                                    f"(registration generation {want} -> {now}); nothing was sent; allowed a "
                                    f"reconnect with its current metadata")

    def _engine_disconnect(self, peer: PeerInfo) -> None:
        self._peer_gen.pop(peer.name, None)
        self._stale.pop(peer.name, None)
        self._drop_prepped(lambda key: key[0] == peer.name)
        self._acked.discard(peer.name)
        try:
            if peer.name not in self._gone:
                with _engine_errors_muted():  # Note [Goodbyes to a gone peer]
                    self._agent.send_notif(peer.name, FORGET)
                self._agent.get_new_notifs()
        except Exception:  # a peer already gone needs no goodbye
            pass
        self._gone.discard(peer.name)
        try:
            self._agent.remove_remote_agent(peer.name)
        except Exception:  # a peer already gone is fine to forget
            pass

    def _engine_peer_alive(self, peer: PeerInfo) -> bool:
        """Down once the peer's agent said goodbye (its ``close`` sends BYE) or, in this process, closed."""
        self._engine_progress()
        return not self._peer_closed(peer.name)

    def _peer_closed(self, peer: str) -> bool:
        if peer in self._gone:
            return True
        other = _AGENTS.get(peer)
        info = self._peers.get(peer)
        return info is not None and info.pid == os.getpid() and (other is None or other.closed)

    # ---- transfers -------------------------------------------------------------------------------------
    def _use_prepped(self, d: np.ndarray, item_bytes: int | None) -> bool:
        if item_bytes is None or self.mode == "oneshot":
            return False
        if self.mode == "prepped":
            return True
        pages = float(d[:, 2].sum()) / item_bytes
        return pages <= PREP_MAX_PAGES_PER_DESC * d.shape[0]

    def _prepped_lists(self, peer: PeerInfo, sreg: Region, dreg: Region, item_bytes: int) -> tuple:
        key = (peer.name, sreg, dreg, item_bytes)
        got = self._prepped.get(key)
        if got is None:
            def items(reg: Region) -> np.ndarray:
                k = reg.nbytes // item_bytes
                arr = np.empty((k, 3), dtype=np.uint64)
                arr[:, 0] = np.uint64(reg.base_ptr) + np.arange(k, dtype=np.uint64) * np.uint64(item_bytes)
                arr[:, 1] = item_bytes
                arr[:, 2] = _dev_id(reg)
                return arr

            local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", items(sreg), mem_type=sreg.mem_kind,
                                                backends=["UCX"])
            remote = self._agent.prep_xfer_dlist(peer.name, items(dreg), mem_type=dreg.mem_kind, backends=["UCX"])
            got = self._prepped[key] = (local, remote)
        return got

    @staticmethod
    def _page_indices(addrs: np.ndarray, nbytes: np.ndarray, base: int, item_bytes: int) -> np.ndarray:
        first = (addrs - np.uint64(base)) // np.uint64(item_bytes)
        counts = (nbytes // np.uint64(item_bytes)).astype(np.int64)
        total = int(counts.sum())
        run_start = np.cumsum(counts) - counts
        within = np.arange(total, dtype=np.int64) - np.repeat(run_start, counts)
        return (np.repeat(first.astype(np.int64), counts) + within).astype(np.int32)

    def _engine_post(self, h: TransferHandle, chunks: list[Chunk], peer: PeerInfo, item_bytes: int | None) -> None:
        """One request per chunk and memory-kind group, in order; each request one part of ``h``."""
        parts: list[dict] = []
        h.engine["parts"] = parts
        self._engine_progress()
        if self._peer_closed(peer.name):
            raise TransferError(f"nixl: peer {peer.name!r} closed before the transfer")
        for d, src_idx, dst_idx in chunks:
            self._post_chunk(h, parts, d, src_idx, dst_idx, peer, item_bytes)

    def _post_chunk(self, h: TransferHandle, parts: list[dict], d: np.ndarray, src_idx: np.ndarray,
                    dst_idx: np.ndarray, peer: PeerInfo, item_bytes: int | None) -> None:
        """Post one chunk: one request per (source kind/device, destination kind/device) group, appended to
        ``parts``; prepared lists where Note [NIXL post mode] says so."""
        src_regions = self._reg.regions
        if (src_idx == src_idx[0]).all() and (dst_idx == dst_idx[0]).all():
            batches: list[np.ndarray | None] = [None]
        else:  # one request per (source kind/device, destination kind/device)
            codes: dict[tuple[str, int], int] = {}
            sk = np.array([codes.setdefault((r.mem_kind, _dev_id(r)), len(codes)) for r in src_regions], np.int64)
            pk = np.array([codes.setdefault((r.mem_kind, _dev_id(r)), len(codes)) for r in peer.regions], np.int64)
            key = np.stack([sk[src_idx], pk[dst_idx]], axis=1)
            _, inverse = np.unique(key, axis=0, return_inverse=True)
            inverse = inverse.reshape(-1)
            batches = [np.flatnonzero(inverse == g) for g in range(int(inverse.max()) + 1)]
        for rows in batches:
            sub = d if rows is None else d[rows]
            si = src_idx if rows is None else src_idx[rows]
            di = dst_idx if rows is None else dst_idx[rows]
            sreg = src_regions[int(si[0])]
            dreg = peer.regions[int(di[0])]
            one_region = rows is None or (bool((si == si[0]).all()) and bool((di == di[0]).all()))
            if one_region and self._use_prepped(sub, item_bytes) and self._aligned(sub, sreg, dreg, item_bytes):
                lh, rh = self._prepped_lists(peer, sreg, dreg, item_bytes)
                lidx = self._page_indices(sub[:, 0], sub[:, 2], sreg.base_ptr, item_bytes)
                ridx = self._page_indices(sub[:, 1], sub[:, 2], dreg.base_ptr, item_bytes)
                xh = self._agent.make_prepped_xfer("WRITE", lh, lidx, rh, ridx, backends=["UCX"])
                h.engine["mode"] = "prepped"
            else:
                n = sub.shape[0]
                loc = np.empty((n, 3), dtype=np.uint64)
                rem = np.empty((n, 3), dtype=np.uint64)
                loc[:, 0] = sub[:, 0]
                loc[:, 1] = sub[:, 2]
                loc[:, 2] = _dev_id(sreg)
                rem[:, 0] = sub[:, 1]
                rem[:, 1] = sub[:, 2]
                rem[:, 2] = _dev_id(dreg)
                xh = self._agent.initialize_xfer("WRITE", self._agent.get_xfer_descs(loc, sreg.mem_kind),
                                                 self._agent.get_xfer_descs(rem, dreg.mem_kind), peer.name,
                                                 backends=["UCX"])
                h.engine["mode"] = "oneshot"
            part = {"xh": xh, "state": "pending", "error": None}
            parts.append(part)
            h.num_parts = len(parts)
            st = self._agent.transfer(xh)
            if st == "DONE":
                part["state"] = "done"
            elif st == "ERR":
                part["state"] = "failed"
                part["error"] = TransferError(f"nixl: posting to {peer.name!r} returned ERR")

    @staticmethod
    def _aligned(d: np.ndarray, sreg: Region, dreg: Region, item_bytes: int | None) -> bool:
        if item_bytes is None:
            return False
        ib = np.uint64(item_bytes)
        return not ((d[:, 0] - np.uint64(sreg.base_ptr)) % ib).any() and not (
            (d[:, 1] - np.uint64(dreg.base_ptr)) % ib).any() and not (d[:, 2] % ib).any()

    def _engine_poll(self, h: TransferHandle) -> tuple[int, BaseException | None]:
        pending = 0
        err = None
        closed = self._peer_closed(h.peer)
        for part in h.engine.get("parts", ()):
            if part["state"] == "pending" and closed:
                part["state"] = "failed"
                part["error"] = TransferError(f"nixl: peer {h.peer!r} closed during the transfer")
                self._release_xh(part)
            if part["state"] == "pending":
                try:
                    st = self._agent.check_xfer_state(part["xh"])
                except Exception as e:
                    st = "ERR"
                    part["error"] = TransferError(f"nixl: transfer to {h.peer!r} failed: {type(e).__name__}: {e}")
                    part["error"].__cause__ = e
                if st == "DONE":
                    part["state"] = "done"
                elif st == "ERR":
                    part["state"] = "failed"
                    if part["error"] is None:
                        part["error"] = TransferError(f"nixl: transfer to {h.peer!r} reported ERR")
                else:
                    pending += 1
            if part["state"] == "failed" and err is None:
                err = part["error"]
        return pending, err

    def _engine_cancel(self, h: TransferHandle) -> None:
        for part in h.engine.get("parts", ()):
            if part["state"] == "pending":
                part["state"] = "failed"
                part["error"] = TransferError("nixl: cancelled")
                self._release_xh(part)

    def _release_xh(self, part: dict) -> None:
        xh = part.pop("xh", None)
        if xh is None:
            return
        try:
            xh.release()
        except Exception:  # still active in NIXL: retry later (the agent must not leak it) and keep it in flight
            part["zombie"] = xh
            self._zombies.append(part)

    def _engine_in_flight(self, h: TransferHandle) -> int:
        """Parts NIXL may still be running: pending requests not released yet (their state read from NIXL now:
        a handle in doubt after a deadline keeps its requests, Note [NIXL cancel and leases]), and zombies."""
        if self._agent is not None and any(p["state"] == "pending" and "xh" in p for p in h.engine.get("parts", ())):
            self._engine_poll(h)
        return sum(1 for part in h.engine.get("parts", ())
                   if "zombie" in part or (part["state"] == "pending" and "xh" in part))

    def _engine_free(self, h: TransferHandle) -> None:
        for part in h.engine.get("parts", ()):
            self._release_xh(part)
        h.engine.pop("parts", None)

    def _engine_progress(self) -> None:
        try:
            notifs = self._agent.get_new_notifs()
        except Exception:  # pragma: no cover - a progress error surfaces through transfer states
            notifs = {}
        for sender, msgs in notifs.items():
            sender = sender.decode() if isinstance(sender, bytes) else str(sender)
            for msg in msgs:
                self._on_notif(sender, bytes(msg))
        if self._zombies:
            keep = []
            for part in self._zombies:
                try:
                    part["zombie"].release()
                except Exception:
                    keep.append(part)
                else:
                    del part["zombie"]
            self._zombies = keep

    def _on_notif(self, sender: str, msg: bytes) -> None:
        """Note [NIXL peer handshake]."""
        if msg.startswith(HELLO):
            gen_s, _, agent_md = msg[len(HELLO):].partition(b":")
            if not gen_s.isdigit() or int(gen_s) != self._reg_gen:
                try:   # Note [NIXL registration generations]: stale metadata; the sender's connect refuses
                    if sender not in self._peers and sender not in self._loaded_stale:
                        self._agent.add_remote_agent(agent_md)
                        self._loaded_stale.add(sender)
                    with _engine_errors_muted():  # Note [Goodbyes to a gone peer]
                        self._agent.send_notif(sender, STALE + str(self._reg_gen).encode())
                except Exception:  # a sender we cannot answer times out in its connect
                    pass
                return
            try:
                if sender not in self._peers:  # (a peer we send to is loaded already: keep that connection)
                    if sender in self._senders or sender in self._loaded_stale:
                        self._agent.remove_remote_agent(sender)  # a sender reconnecting: refresh
                        self._loaded_stale.discard(sender)
                    self._agent.add_remote_agent(agent_md)
                self._senders.add(sender)
                with _engine_errors_muted():  # Note [Goodbyes to a gone peer]
                    self._agent.send_notif(sender, ACK)
            except Exception:  # a sender we cannot answer times out in its connect
                self._senders.discard(sender)
        elif msg == ACK:
            self._acked.add(sender)
        elif msg.startswith(STALE) or msg.startswith(REGEN):
            gen_s = msg[len(STALE if msg.startswith(STALE) else REGEN):]
            if gen_s.isdigit():
                self._stale[sender] = int(gen_s)
        elif msg == BYE:
            self._gone.add(sender)
        elif msg == FORGET and sender in self._senders:
            self._senders.discard(sender)
            if sender not in self._peers:
                try:
                    self._agent.remove_remote_agent(sender)
                except Exception:  # pragma: no cover
                    pass

    @property
    def num_zombie_requests(self) -> int:
        """Cancelled requests NIXL has not let go of yet (retried on every progress)."""
        return len(self._zombies)

    #: How long ``close`` keeps progressing to flush its goodbyes (seconds).
    close_flush_s = 0.02

    def _on_reset(self, old_peer_id: str) -> None:
        self._say_bye()
        self._acked.clear()
        self._gone.clear()

    def _engine_close(self) -> None:
        self._drop_prepped(lambda key: True)
        self._say_bye()
        for part in self._zombies:  # the agent ends below, and every request with it
            part.pop("zombie", None)
        self._zombies.clear()
        for h in self._ht.draining.values():  # requests of handles in doubt go with the agent too
            for part in h.engine.get("parts", ()):
                if part["state"] == "pending":
                    part["state"] = "failed"
                    part["error"] = TransferError("nixl: the agent closed while the request was in doubt")
                part.pop("xh", None)
        _AGENTS.pop(self.agent_name, None)
        agent = getattr(self, "_agent", None)
        self._agent = None
        del agent  # the agent (and its UCX worker) ends here

    def _say_bye(self) -> None:
        """Tell every sender that said hello that this target is gone (Note [NIXL peer handshake]). Pending
        notifications are taken in first, for up to :attr:`close_flush_s` while senders remain: a sender that
        said forget (it disconnected, or closed and exited) gets no goodbye (Note [Goodbyes to a gone peer])."""
        end = time.monotonic() + self.close_flush_s
        self._engine_progress()
        while self._senders and time.monotonic() < end:
            time.sleep(0.0005)
            self._engine_progress()
        said = 0
        for sender in sorted(self._senders):
            try:
                with _engine_errors_muted():  # Note [Goodbyes to a gone peer]
                    self._agent.send_notif(sender, BYE)
                said += 1
            except Exception:  # a sender already gone needs no goodbye
                pass
        end = time.monotonic() + (self.close_flush_s if said else 0.0)
        while True:
            self._engine_progress()
            if time.monotonic() >= end:
                break
            time.sleep(0.0005)
        for sender in self._senders:
            try:
                self._agent.remove_remote_agent(sender)
            except Exception:  # pragma: no cover
                pass
        self._senders.clear()
