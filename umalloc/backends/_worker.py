"""A backend in a second process: the sender/receiver harness for tests, benchmarks and the replay.

Policy:

* :class:`BackendWorker` starts one ``spawn`` child (never ``fork``: engines start threads) that owns one backend
  and a few torch ``uint8`` host buffers, and answers commands sent over a pipe. Every call is bounded by a
  timeout; replies carry the request's sequence number, so a reply that arrives after its call timed out is
  dropped instead of answering the next call.
* While idle the child progresses its backend every ``idle_poll_s`` when the backend needs it (a NIXL target
  without a progress thread advances only when progressed); otherwise it just waits for the next command. The parent may pass ``progress=`` to :meth:`BackendWorker.call` to progress its
  own backend while it waits for a reply (a parent-side NIXL receiver).
* Errors raised in the child come back as the same umalloc exception type (message, picklable attributes and
  remote traceback kept); anything else becomes :class:`WorkerError`. A child that dies raises :class:`WorkerDied`.
* Startup costs a few seconds (interpreter + torch + engine), so start workers early (``start()`` does not
  block; :meth:`BackendWorker.wait_ready` does) and share them across tests.
* :meth:`BackendWorker.close` always ends the child: a polite ``exit``, then ``terminate``, then ``kill``.
  :meth:`pause` / :meth:`resume` (SIGSTOP / SIGCONT) and :meth:`kill` serve failure tests.

Commands (``call(name, ...)``) are the ``cmd_*`` methods of :class:`WorkerContext`; :meth:`BackendWorker.run` calls
any importable ``"module:function"`` as ``function(ctx, *args, **kw)`` inside the child.
"""

from __future__ import annotations

import importlib
import itertools
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback

from umalloc.errors import BackendError

#: Idle progress interval of the child (seconds).
IDLE_POLL_S = 0.0002


class WorkerError(BackendError):
    """An exception of a non-umalloc type raised inside the worker (type name and remote traceback kept)."""


class WorkerDied(BackendError):
    """The worker process ended while a call was outstanding."""


class WorkerTimeout(BackendError, TimeoutError):
    """A worker call did not answer before its timeout."""


def pattern_fill(buf: object, seed: int) -> None:
    """Fill a torch ``uint8`` tensor with ``torch.randint(0, 256, generator=Generator().manual_seed(seed))``."""
    import torch

    g = torch.Generator().manual_seed(int(seed))
    buf.copy_(torch.randint(0, 256, (buf.numel(),), generator=g, dtype=torch.uint8))


class WorkerContext:
    """State of the child: the backend and the buffers. Commands are its ``cmd_*`` methods."""

    def __init__(self, backend_name: str, backend_kw: dict) -> None:
        self.backend_name = backend_name
        self.backend_kw = dict(backend_kw)
        self.backend = None
        self.buffers: dict[int, object] = {}
        self.handles: dict[int, object] = {}
        self.objects: dict[str, object] = {}  # free slot for run() functions
        self.progress_enabled = True
        self._ids = itertools.count(1)

    # ---- backend ---------------------------------------------------------------------------------------
    def cmd_new_backend(self, **kw: object) -> str:
        """Close the current backend (if any) and start a fresh one; returns its peer id."""
        from umalloc.backends import get_backend

        self.cmd_close_backend()
        merged = dict(self.backend_kw)
        merged.update(kw)
        self.backend = get_backend(self.backend_name, **merged)
        return self.backend.peer_id

    def cmd_close_backend(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        self.handles.clear()

    def cmd_reset_backend(self) -> str:
        """``backend.reset()`` (drops handles, peers, registrations, layout); returns the new peer id."""
        self._b().reset()
        self.handles.clear()
        self.objects.pop("arena", None)
        return self.backend.peer_id

    def _b(self):
        if self.backend is None:
            self.cmd_new_backend()
        return self.backend

    def cmd_set_layout(self, layout: dict | None) -> None:
        self._b().set_layout(layout)

    def cmd_register(self, regions: list[dict]) -> None:
        from umalloc.geometry.region import Region

        self._b().register([Region.from_dict(r) for r in regions])

    def cmd_deregister(self, regions: list[dict]) -> None:
        from umalloc.geometry.region import Region

        self._b().deregister([Region.from_dict(r) for r in regions])

    def cmd_metadata(self) -> bytes:
        return self._b().metadata()

    def cmd_connect(self, peer_metadata: bytes) -> str:
        return self._b().connect(peer_metadata)

    def cmd_stats(self) -> dict:
        return self._b().stats()

    def cmd_check_invariants(self) -> None:
        self._b().check_invariants()

    def cmd_set_progress(self, enabled: bool) -> None:
        """Turn idle progress of the backend on or off (off: a NIXL target stops advancing)."""
        self.progress_enabled = bool(enabled)

    # ---- buffers ---------------------------------------------------------------------------------------
    def cmd_alloc(self, nbytes: int, seed: int | None = None) -> tuple[int, int]:
        """A zeroed (or :func:`pattern_fill`-ed) torch uint8 host buffer; returns ``(buf_id, base_ptr)``."""
        import torch

        buf = torch.zeros(int(nbytes), dtype=torch.uint8)
        if seed is not None:
            pattern_fill(buf, seed)
        bid = next(self._ids)
        self.buffers[bid] = buf
        return bid, int(buf.data_ptr())

    def cmd_free(self, buf_id: int) -> None:
        del self.buffers[buf_id]

    def cmd_fill(self, buf_id: int, seed: int | None) -> None:
        buf = self.buffers[buf_id]
        if seed is None:
            buf.zero_()
        else:
            pattern_fill(buf, seed)

    def cmd_read(self, buf_id: int, offset: int = 0, nbytes: int | None = None) -> bytes:
        buf = self.buffers[buf_id]
        end = buf.numel() if nbytes is None else offset + nbytes
        return bytes(buf[offset:end].numpy().tobytes())

    def cmd_read_many(self, buf_id: int, offsets: list[int], nbytes: int) -> bytes:
        """``nbytes`` at each offset, concatenated (spot checks of large buffers)."""
        buf = self.buffers[buf_id]
        return b"".join(bytes(buf[o:o + nbytes].numpy().tobytes()) for o in offsets)

    # ---- transfers -------------------------------------------------------------------------------------
    def cmd_write(self, descriptors: object, peer: str, timeout_s: float, item_bytes: int | None = None,
                  repeat: int = 1) -> dict:
        """Post the batch ``repeat`` times, waiting for each; returns ``{"elapsed_s": [...], "num_parts": n}``."""
        b = self._b()
        times = []
        parts = 0
        for _ in range(int(repeat)):
            t0 = time.perf_counter()
            h = b.write_descriptors(descriptors, peer, item_bytes=item_bytes)
            try:
                b.wait(h, timeout_s)
            finally:
                b.release(h)
            times.append(time.perf_counter() - t0)
            parts = h.num_parts
        return {"elapsed_s": times, "num_parts": parts}

    def cmd_post(self, descriptors: object, peer: str, item_bytes: int | None = None) -> int:
        """Post without waiting; returns a handle id for ``poll`` / ``wait`` / ``release``."""
        h = self._b().write_descriptors(descriptors, peer, item_bytes=item_bytes)
        self.handles[h.handle_id] = h
        return h.handle_id

    def cmd_poll(self, handle_id: int) -> str:
        return self._b().poll(self.handles[handle_id])

    def cmd_wait(self, handle_id: int, timeout_s: float) -> float:
        h = self.handles[handle_id]
        self._b().wait(h, timeout_s)
        return float(h.elapsed_s)

    def cmd_release(self, handle_id: int) -> None:
        h = self.handles.pop(handle_id)
        self._b().release(h)

    def cmd_drain(self, handle_id: int, timeout_s: float) -> bool:
        """``backend.drain`` of a handle posted with ``post`` (and not released yet)."""
        return self._b().drain(self.handles[handle_id], timeout_s)

    def progress(self) -> None:
        if self.backend is not None and self.progress_enabled and not self.backend.closed:
            self.backend.progress()


def _describe(e: BaseException) -> tuple[str, str, str, str, dict]:
    """What travels back for an exception: type, message, traceback, and its picklable attributes (so e.g.
    ``IncompatiblePeerError.differences`` or ``OutOfPages.requested`` survive the trip)."""
    attrs = {}
    for k, v in vars(e).items():
        try:
            pickle.dumps(v)
        except Exception:  # an attribute that cannot travel stays behind
            continue
        attrs[k] = v
    return (type(e).__module__, type(e).__qualname__, str(e),
            "".join(traceback.format_exception(type(e), e, e.__traceback__)), attrs)


def _serve(conn, backend_name: str, backend_kw: dict, env: dict, idle_poll_s: float) -> None:
    os.environ.update(env)
    ctx = WorkerContext(backend_name, backend_kw)
    try:
        ctx.cmd_new_backend()
    except BaseException as e:  # report a start failure instead of dying silently
        conn.send((0, "err", _describe(e)))
        return
    conn.send((0, "ok", os.getpid()))
    while True:
        try:
            needs = ctx.backend is not None and ctx.backend.needs_progress and ctx.progress_enabled
            if not conn.poll(idle_poll_s if needs else 0.05):
                ctx.progress()
                continue
            seq, cmd, args, kw = conn.recv()
        except (EOFError, OSError):  # parent went away
            break
        if cmd == "exit":
            try:
                ctx.cmd_close_backend()
            finally:
                conn.send((seq, "ok", None))
            break
        try:
            if cmd == "run":
                mod_name, fn_name = args[0].split(":", 1)
                fn = getattr(importlib.import_module(mod_name), fn_name)
                res = fn(ctx, *args[1:], **kw)
            else:
                res = getattr(ctx, "cmd_" + cmd)(*args, **kw)
            conn.send((seq, "ok", res))
        except BaseException as e:
            conn.send((seq, "err", _describe(e)))
    try:
        ctx.cmd_close_backend()
    except BaseException:  # pragma: no cover
        pass


def _rebuild(info: tuple[str, str, str, str, dict]) -> BaseException:
    module, qualname, message, tb, attrs = info
    exc: BaseException
    cls = None
    if module.startswith("umalloc."):
        try:
            cls = getattr(importlib.import_module(module), qualname)
        except (ImportError, AttributeError):
            cls = None
    if isinstance(cls, type) and issubclass(cls, BaseException):
        exc = cls.__new__(cls)
        Exception.__init__(exc, message)
        exc.__dict__.update(attrs)
    else:
        exc = WorkerError(f"{qualname}: {message}")
    exc.remote_traceback = tb  # type: ignore[attr-defined]
    return exc


class BackendWorker:
    """A backend in a spawned child process.

    Args:
        backend: backend name for :func:`umalloc.backends.get_backend` in the child.
        backend_kw: constructor keywords for it.
        env: environment variables set in the child before anything is imported there.
        idle_poll_s: child's idle progress interval.

    >>> import numpy as np
    >>> w = BackendWorker("local")
    >>> bid, ptr = w.call("alloc", 16, seed=1)
    >>> len(w.call("read", bid, 0, 4))
    4
    >>> w.close()
    """

    def __init__(self, backend: str, *, backend_kw: dict | None = None, env: dict | None = None,
                 idle_poll_s: float = IDLE_POLL_S) -> None:
        self.backend = backend
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, name=f"umalloc-worker-{backend}",
                                   args=(child, backend, dict(backend_kw or {}), dict(env or {}), idle_poll_s),
                                   daemon=True)
        self.process.start()
        child.close()
        self._seq = itertools.count(1)
        self._ready = False
        self._closed = False

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def alive(self) -> bool:
        return self.process.is_alive()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until the child's backend is up.

        Raises:
            WorkerTimeout / WorkerDied / the child's start error.
        """
        if self._ready:
            return
        self._recv(0, timeout_s, None)
        self._ready = True

    def _recv(self, seq: int, timeout_s: float, progress) -> object:
        deadline = time.monotonic() + timeout_s
        step = IDLE_POLL_S if progress is not None else 0.02
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerTimeout(f"{self.backend} worker (pid {self.pid}): no reply to request {seq} "
                                    f"within {timeout_s:.3g} s")
            try:
                ready = self._conn.poll(min(step, remaining))
            except (EOFError, OSError) as e:
                raise WorkerDied(f"{self.backend} worker (pid {self.pid}) pipe closed: {e}") from e
            if not ready:
                if progress is not None:
                    progress()
                if not self.process.is_alive() and not self._conn.poll(0):
                    raise WorkerDied(f"{self.backend} worker (pid {self.pid}) exited with code "
                                     f"{self.process.exitcode}")
                continue
            try:
                got_seq, status, payload = self._conn.recv()
            except (EOFError, OSError) as e:
                raise WorkerDied(f"{self.backend} worker (pid {self.pid}) died: {e}") from e
            if got_seq != seq:
                continue  # a late reply to a call that timed out
            if status == "err":
                raise _rebuild(payload)
            return payload

    def call(self, cmd: str, *args: object, timeout_s: float = 30.0, progress=None, **kw: object) -> object:
        """Run ``WorkerContext.cmd_<cmd>(*args, **kw)`` in the child and return its result.

        Args:
            timeout_s: bound on the whole call (including the child's work).
            progress: called while waiting (e.g. the parent backend's ``progress``), or ``None``.

        Raises:
            WorkerTimeout, WorkerDied, or the child's exception (same umalloc type).
        """
        if self._closed:
            raise BackendError(f"{self.backend} worker is closed")
        self.wait_ready()
        seq = next(self._seq)
        try:
            self._conn.send((seq, cmd, args, kw))
        except (OSError, ValueError) as e:
            raise WorkerDied(f"{self.backend} worker (pid {self.pid}) cannot take requests: {e}") from e
        return self._recv(seq, timeout_s, progress)

    def run(self, target: str, *args: object, timeout_s: float = 60.0, progress=None, **kw: object) -> object:
        """Call importable ``"module:function"`` as ``function(ctx, *args, **kw)`` in the child."""
        return self.call("run", target, *args, timeout_s=timeout_s, progress=progress, **kw)

    # ---- failure injection -----------------------------------------------------------------------------
    def pause(self) -> None:
        """SIGSTOP the child (its engine stops answering)."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self, timeout_s: float = 10.0) -> None:
        """SIGKILL the child and reap it."""
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(timeout_s)
        self._closed = True

    def close(self, timeout_s: float = 10.0) -> None:
        """End the child: ``exit`` command, then terminate, then kill. Idempotent."""
        if self.process.is_alive() and not self._closed:
            try:
                os.kill(self.pid, signal.SIGCONT)
                self._closed = False
                seq = next(self._seq)
                self._conn.send((seq, "exit", (), {}))
                self._recv(seq, timeout_s, None)
            except Exception:
                pass
        self._closed = True
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout_s)
        if self.process.is_alive():  # pragma: no cover
            self.process.kill()
            self.process.join(timeout_s)
        self._conn.close()

    def __enter__(self) -> BackendWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ==== KV sides for plan-level runs (harness code: it drives an allocator, the engine layer never does) =========


def kv_setup(ctx: WorkerContext, layout: dict, seed: int | None = None) -> dict:
    """Create an arena + allocator for the spec of ``layout`` (a ``PeerLayout.to_dict()``), fill it with
    :func:`pattern_fill` (``seed``) or zeros, register the arena with the backend and publish its layout.

    Returns:
        This side's ``PeerLayout.to_dict()``.
    """
    from umalloc.core.allocator import MultiEndedAllocator
    from umalloc.geometry.arena import Arena
    from umalloc.transfer import PeerLayout

    spec = PeerLayout.from_dict(layout).spec
    arena = Arena(spec)
    if seed is not None:
        pattern_fill(arena.data, seed)
    alloc = MultiEndedAllocator(arena)
    b = ctx._b()
    old = ctx.objects.get("arena")
    if old is not None and all(b.registration_counts().get(r, 0) for r in old.regions()):
        b.deregister(old.regions())
    b.register(arena.regions())
    mine = PeerLayout.from_arena(arena)
    b.set_layout(mine)
    ctx.objects.update(arena=arena, alloc=alloc, halves={}, plans={})
    return mine.to_dict()


def kv_alloc(ctx: WorkerContext, tokens_by_owner: dict[str, int]) -> dict[str, list[int]]:
    """``alloc_extend`` a fresh request of ``n`` tokens per id owner; returns ``{owner: virtual token ids}``."""
    import torch

    alloc = ctx.objects["alloc"]
    out = {}
    for owner, n in tokens_by_owner.items():
        vt = alloc.alloc_extend(torch.tensor([0]), torch.tensor([int(n)]), torch.tensor([-1]), owner=owner)
        if vt is None:
            raise BackendError(f"kv_alloc: no space for {n} tokens of {owner!r}")
        out[owner] = vt.tolist()
    return out


def _vtokens(v: dict[str, list[int]]) -> dict:
    import torch

    return {o: torch.tensor(t, dtype=torch.int64) for o, t in v.items()}


def kv_receiver_half(ctx: WorkerContext, request_id: str, vtokens: dict[str, list[int]], prefix_tokens: int = 0,
                     seq_len_tokens: int | None = None) -> dict:
    """Build and keep (leased) the receiver half of a request; returns ``half.to_dict()``."""
    from umalloc.transfer import build_receiver_half

    half = build_receiver_half(request_id, ctx.objects["alloc"], _vtokens(vtokens), prefix_tokens=prefix_tokens,
                               seq_len_tokens=seq_len_tokens)
    ctx.objects["halves"][request_id] = half
    return half.to_dict()


def kv_finish_half(ctx: WorkerContext, request_id: str, ok: bool = True) -> int:
    """Complete (or fail) a kept receiver half, releasing its lease; returns the allocator's active leases."""
    half = ctx.objects["halves"].pop(request_id)
    half.complete() if ok else half.fail(None)
    return ctx.objects["alloc"].leases_active()


def kv_send(ctx: WorkerContext, request_id: str, half: dict, peer: str, vtokens: dict[str, list[int]],
            timeout_s: float = 30.0, wait: bool = True) -> dict:
    """Build the sender plan from a receiver half and submit it; with ``wait`` wait for it and release the handle.

    A failed wait is followed by a bounded ``drain`` (up to ``timeout_s`` more), so the outcome is reported only
    once the sender's plan ended and the receiver may release its half (Note [Deadlines and in-flight parts]);
    ``"draining": True`` says the engine still held a part when the drain gave up: keep the receiver's half.

    Returns:
        ``{"state", "plan_state", "draining", "descriptors", "bytes", "num_parts", "handle_id", "leases_active",
        "error"}``.
    """
    from umalloc.transfer import build_send_plan

    b = ctx._b()
    plan = build_send_plan(request_id, ctx.objects["alloc"], _vtokens(vtokens), half, b.peer_layout(peer))
    h = b.submit(plan, peer)
    err = None
    if wait:
        try:
            b.wait(h, timeout_s)
        except BackendError as e:
            err = f"{type(e).__name__}: {e}"
            b.drain(h, timeout_s)
        b.release(h)
    else:
        ctx.handles[h.handle_id] = h
    return {"state": h.state, "plan_state": plan.state, "draining": h.draining, "descriptors": plan.num_descriptors,
            "bytes": plan.total_bytes, "num_parts": h.num_parts, "handle_id": h.handle_id,
            "leases_active": ctx.objects["alloc"].leases_active(), "error": err}


def kv_arena_bytes(ctx: WorkerContext) -> bytes:
    """The whole arena's bytes."""
    return bytes(ctx.objects["arena"].data.numpy().tobytes())


def kv_leases_active(ctx: WorkerContext) -> int:
    return ctx.objects["alloc"].leases_active()


def kv_translate_pages(ctx: WorkerContext, vpages: list[int], end: str) -> list[int]:
    """Physical pages of ``end`` for virtual pages ``vpages`` (strict)."""
    import torch

    return ctx.objects["alloc"].translate_pages(torch.tensor(vpages, dtype=torch.int64), end).tolist()
