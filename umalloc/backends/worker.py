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

Note [Submitted requests]
~~~~~~~~~~~~~~~~~~~~~~~~~
:meth:`BackendWorker.submit` sends a ``run`` request and returns its sequence number at once; the child answers
requests one at a time, in the order sent. :meth:`BackendWorker.poll` reads every reply that has arrived without
blocking (or up to a bound) and keeps the replies to submitted requests until :meth:`BackendWorker.result` takes
them, so a blocking :meth:`BackendWorker.call` made while submitted requests are outstanding (it is answered after
them) never drops their replies; a reply to a request nobody waits for (a call that timed out, a submitted request
given up with :meth:`BackendWorker.discard`) is dropped. The caller bounds a submitted request itself (the worker
cannot know how long the requests queued before it take).
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
from collections.abc import Callable

from umalloc.backends import get_backend
from umalloc.errors import BackendError
from umalloc.geometry.region import Region

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
        self._b().register([Region.from_dict(r) for r in regions])

    def cmd_deregister(self, regions: list[dict]) -> None:
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
                b.forget(h)
            times.append(time.perf_counter() - t0)
            parts = h.num_parts
        return {"elapsed_s": times, "num_parts": parts}

    def cmd_post(self, descriptors: object, peer: str, item_bytes: int | None = None) -> int:
        """Post without waiting; returns a handle id for ``poll`` / ``wait`` / ``forget``."""
        h = self._b().write_descriptors(descriptors, peer, item_bytes=item_bytes)
        self.handles[h.handle_id] = h
        return h.handle_id

    def cmd_poll(self, handle_id: int) -> str:
        return self._b().poll(self.handles[handle_id])

    def cmd_wait(self, handle_id: int, timeout_s: float) -> float:
        h = self.handles[handle_id]
        self._b().wait(h, timeout_s)
        return float(h.elapsed_s)

    def cmd_forget(self, handle_id: int) -> None:
        h = self.handles.pop(handle_id)
        self._b().forget(h)

    def cmd_drain(self, handle_id: int, timeout_s: float) -> bool:
        """``backend.drain`` of a handle posted with ``post`` (and not forgotten yet)."""
        return self._b().drain(self.handles[handle_id], timeout_s)

    def progress(self) -> None:
        if self.backend is not None and self.progress_enabled and not self.backend.closed:
            self.backend.progress()


def _describe(e: BaseException) -> tuple[str, str, str, str, dict]:
    """What travels back for an exception: type, message, traceback, and its picklable attributes (so e.g.
    ``IncompatiblePeerError.differences`` survives the trip)."""
    attrs = {}
    for k, v in vars(e).items():
        try:
            pickle.dumps(v)
        except Exception:  # an attribute that cannot travel stays behind
            continue
        attrs[k] = v
    return (type(e).__module__, type(e).__qualname__, str(e),
            "".join(traceback.format_exception(type(e), e, e.__traceback__)), attrs)


def _reply(conn, message: tuple) -> bool:
    """Send ``message`` to the parent; False when the parent has gone (its end of the pipe is closed: it exited
    or was interrupted), so the child ends quietly instead of printing a BrokenPipeError."""
    try:
        conn.send(message)
    except (BrokenPipeError, EOFError, ConnectionResetError):
        return False
    return True


def _serve(conn, backend_name: str, backend_kw: dict, env: dict, idle_poll_s: float) -> None:
    os.environ.update(env)
    ctx = WorkerContext(backend_name, backend_kw)
    try:
        ctx.cmd_new_backend()
    except BaseException as e:  # report a start failure instead of dying silently
        _reply(conn, (0, "err", _describe(e)))
        return
    parent_here = _reply(conn, (0, "ok", os.getpid()))
    while parent_here:
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
                _reply(conn, (seq, "ok", None))
            break
        try:
            if cmd == "run":
                mod_name, fn_name = args[0].split(":", 1)
                fn = getattr(importlib.import_module(mod_name), fn_name)
                res = fn(ctx, *args[1:], **kw)
            else:
                res = getattr(ctx, "cmd_" + cmd)(*args, **kw)
            parent_here = _reply(conn, (seq, "ok", res))
        except BaseException as e:
            parent_here = _reply(conn, (seq, "err", _describe(e)))
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


def _all_threads_stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped or exited (``T``/``t``/``Z``/``X`` in ``/proc/<pid>/task/*/stat``);
    True where ``/proc`` does not list the process (not Linux, or the process is gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        state = stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3]  # the field after "(comm)"
        if state not in (b"T", b"t", b"Z", b"X"):  # stopped, traced, or exited: it runs no more
            return False
    return True


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
        self._awaited: set[int] = set()  # submitted requests whose reply is wanted (Note [Submitted requests])
        self._replies: dict[int, tuple[str, object]] = {}  # their replies, until result() takes them

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
                if got_seq in self._awaited:  # a submitted request's: kept for result()
                    self._replies[got_seq] = (status, payload)
                continue  # otherwise a late reply to a call that timed out
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

    def submit(self, target: str, *args: object, **kw: object) -> int:
        """Send ``run(target, *args, **kw)`` to the child and return at once (Note [Submitted requests]).

        Returns:
            The request's sequence number, for :meth:`poll`, :meth:`result` and :meth:`discard`.

        Raises:
            BackendError: the worker is closed. WorkerDied: the child cannot take requests. Nothing is sent then.
        """
        if self._closed:
            raise BackendError(f"{self.backend} worker is closed")
        self.wait_ready()
        seq = next(self._seq)
        try:
            self._conn.send((seq, "run", (target, *args), kw))
        except (OSError, ValueError) as e:
            raise WorkerDied(f"{self.backend} worker (pid {self.pid}) cannot take requests: {e}") from e
        self._awaited.add(seq)
        return seq

    def poll(self, seq: int, timeout_s: float = 0.0, progress: Callable[[], object] | None = None) -> bool:
        """True once the reply to submitted request ``seq`` has arrived (kept for :meth:`result`). Reads every
        reply already in the pipe; with ``timeout_s`` 0 it never blocks, otherwise it waits up to ``timeout_s``
        seconds, calling ``progress`` between polls of the pipe.

        Raises:
            WorkerDied: the child ended (or its pipe closed) without answering ``seq``.
            BackendError: ``seq`` is not a submitted request awaiting its result.
        """
        if seq in self._replies:
            return True
        if seq not in self._awaited:
            raise BackendError(f"{self.backend} worker: request {seq} is not a submitted request awaiting a result")
        deadline = time.monotonic() + timeout_s
        step = IDLE_POLL_S if progress is not None else 0.02
        while True:
            try:
                ready = self._conn.poll(max(0.0, min(step, deadline - time.monotonic())))
                if ready:
                    got_seq, status, payload = self._conn.recv()
            except (EOFError, OSError) as e:
                raise WorkerDied(f"{self.backend} worker (pid {self.pid}) died: {e}") from e
            if ready:
                if got_seq in self._awaited:
                    self._replies[got_seq] = (status, payload)
                if seq in self._replies:
                    return True
                continue
            if not self.process.is_alive() and not self._conn.poll(0):
                raise WorkerDied(f"{self.backend} worker (pid {self.pid}) exited with code {self.process.exitcode}")
            if time.monotonic() >= deadline:
                return False
            if progress is not None:
                progress()

    def result(self, seq: int) -> object:
        """Take the reply to submitted request ``seq`` (after :meth:`poll` returned True): its return value.

        Raises:
            The child's exception (same umalloc type, as :meth:`call`). BackendError: no reply to ``seq`` has
            arrived (nothing is taken then).
        """
        if seq not in self._replies:
            raise BackendError(f"{self.backend} worker: no reply to request {seq} yet")
        self._awaited.discard(seq)
        status, payload = self._replies.pop(seq)
        if status == "err":
            raise _rebuild(payload)  # type: ignore[arg-type]
        return payload

    def discard(self, seq: int) -> None:
        """Give up submitted request ``seq``: its reply, kept or still to come, is dropped. Idempotent."""
        self._awaited.discard(seq)
        self._replies.pop(seq, None)

    # ---- failure injection -----------------------------------------------------------------------------
    def pause(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP the child and return once every one of its threads is stopped (its engine answers nothing).

        ``kill`` only queues the signal: on a busy host the child's engine threads may run on for a while
        and answer a probe or drain a transfer. This waits (polling ``/proc``, Linux) until the kernel reports
        each thread stopped; where ``/proc`` is absent it returns after queuing the signal.

        Raises:
            WorkerTimeout: some thread of the child was still running after ``timeout_s`` seconds.
        """
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not _all_threads_stopped(self.pid):
            if time.monotonic() > deadline:
                raise WorkerTimeout(f"{self.backend} worker (pid {self.pid}) not stopped {timeout_s:.3g} s after "
                                    "SIGSTOP")
            time.sleep(0.001)

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
