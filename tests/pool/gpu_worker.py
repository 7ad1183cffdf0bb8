"""CUDA commands for :class:`umalloc.backends.worker.BackendWorker` children, run as
``worker.run("gpu_worker:vram_arena", ...)``: a CUDA arena in the child, filled with seeded bytes and registered
as VRAM with the child's backend. The spawned child imports this module by name (it inherits pytest's
``sys.path``)."""

from __future__ import annotations

import torch

from umalloc.backends.worker import WorkerContext, pattern_fill


def vram_buffer(ctx: WorkerContext, nbytes: int, seed: int) -> int:
    """A CUDA ``uint8`` buffer of ``nbytes`` holding :func:`pattern_fill` bytes of ``seed`` (made on the host,
    copied over), registered as VRAM with the child's backend; kept in ``ctx.objects``. Returns its address."""
    from umalloc.geometry.region import Region

    host = torch.empty(int(nbytes), dtype=torch.uint8)
    pattern_fill(host, seed)
    buf = host.to("cuda")
    torch.cuda.synchronize()
    ctx.objects["vram"] = buf
    ctx._b().register([Region(int(buf.data_ptr()), int(nbytes), f"cuda:{buf.device.index or 0}", "VRAM")])
    return int(buf.data_ptr())


def vram_digest(ctx: WorkerContext) -> bytes:
    """The child's VRAM buffer copied back to the host (for byte checks)."""
    return bytes(ctx.objects["vram"].cpu().numpy().tobytes())


def drop_vram(ctx: WorkerContext) -> None:
    """Forget the child's VRAM buffer (call after ``reset_backend`` deregistered it)."""
    ctx.objects.pop("vram", None)
