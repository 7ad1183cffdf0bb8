"""Checks ``umalloc replay`` runs before anything else: input and output paths, and host memory.

Policy:

* Every check raises :class:`~umalloc.errors.UmallocValueError` with one line naming the option, the value and
  what is allowed; nothing is created, written or allocated by a failed check (an output folder's writability
  is probed with a temporary file that is removed at once).
* A trace must be a readable regular file of text: a directory, a device, or a file whose first
  :data:`SNIFF_BYTES` bytes hold a NUL byte or are not UTF-8 is refused before it is parsed.
* ``--plot`` names a file: a path without a suffix gets ``.png``; an existing directory gets
  :data:`DEFAULT_PLOT_NAME` inside it; a suffix must be one of :data:`PLOT_SUFFIXES`. The path returned is the
  one written (and printed).
* Host memory: the arenas (and the replay's block table) must fit in the memory the kernel reports available
  (``MemAvailable`` of ``/proc/meminfo``; the physical memory where that file is missing), so a size larger
  than the machine is refused up front instead of failing (or swapping) half-way.
"""

from __future__ import annotations

import codecs
import os
import tempfile
from pathlib import Path

from umalloc.errors import UmallocValueError

#: Bytes of a trace file read to tell text from binary.
SNIFF_BYTES = 1 << 16
#: Plot formats (file suffixes) the replay writes.
PLOT_SUFFIXES = (".png", ".pdf", ".svg")
#: File name used when ``--plot`` names an existing directory.
DEFAULT_PLOT_NAME = "umalloc-replay.png"


def check_trace_file(path: str | Path) -> Path:
    """Refuse a trace path that is not a readable text file. Returns the path.

    Raises:
        UmallocValueError: missing, a directory or other non-regular file, unreadable, or binary (a NUL byte or
            invalid UTF-8 in the first :data:`SNIFF_BYTES` bytes).
    """
    p = Path(path)
    if not p.exists():
        raise UmallocValueError(f"--trace {str(p)!r} does not exist: allowed a Mooncake JSONL or Azure CSV file")
    if p.is_dir():
        raise UmallocValueError(f"--trace {str(p)!r} is a directory: allowed a Mooncake JSONL or Azure CSV file")
    if not p.is_file():
        raise UmallocValueError(f"--trace {str(p)!r} is not a regular file: allowed a Mooncake JSONL or Azure CSV "
                                "file")
    try:
        with p.open("rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError as exc:
        raise UmallocValueError(f"--trace {str(p)!r} cannot be read: {exc.strerror}") from None
    if b"\0" in head:
        raise UmallocValueError(f"--trace {str(p)!r} is a binary file (it holds NUL bytes): allowed a Mooncake "
                                "JSONL or Azure CSV text file")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as exc:
        raise UmallocValueError(f"--trace {str(p)!r} is not UTF-8 text (byte {exc.start}): allowed a Mooncake "
                                "JSONL or Azure CSV text file") from None
    return p


def check_output_file(path: str | Path, option: str) -> Path:
    """Refuse an output path that cannot be written, without writing it. Returns the path.

    The file may exist (it is replaced when the replay ends); its folder must exist and accept a new file
    (probed by creating and removing a temporary file next to it).

    Raises:
        UmallocValueError: the path is a directory or not a regular file, its folder is missing or not a folder,
            or the folder (or the existing file) is not writable.
    """
    p = Path(path)
    if p.is_dir():
        raise UmallocValueError(f"{option} {str(p)!r} is a directory: allowed a file path")
    if p.exists() and not p.is_file():
        raise UmallocValueError(f"{option} {str(p)!r} is not a regular file: allowed a file path")
    folder = p.parent
    if not folder.exists():
        raise UmallocValueError(f"{option} {str(p)!r}: the folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise UmallocValueError(f"{option} {str(p)!r}: {str(folder)!r} is not a folder")
    try:
        if p.exists():
            with p.open("ab"):
                pass
        else:
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".umalloc-probe-")
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise UmallocValueError(f"{option} {str(p)!r} cannot be written: {exc.strerror}") from None
    return p


def resolve_plot_path(path: str | Path) -> Path:
    """The file ``--plot PATH`` writes: ``PATH`` itself with a suffix of :data:`PLOT_SUFFIXES`, ``PATH.png``
    without a suffix, ``PATH/`` :data:`DEFAULT_PLOT_NAME` for an existing directory; checked writable
    (:func:`check_output_file`) and matplotlib importable.

    Raises:
        UmallocValueError: another suffix, an unwritable path, or no matplotlib.

    >>> resolve_plot_path("/tmp/occupancy").name, resolve_plot_path("/tmp").name
    ('occupancy.png', 'umalloc-replay.png')
    """
    p = Path(path)
    if p.is_dir():
        p = p / DEFAULT_PLOT_NAME
    elif p.suffix == "":
        p = p.with_name(p.name + ".png")
    elif p.suffix.lower() not in PLOT_SUFFIXES:
        raise UmallocValueError(f"--plot {str(path)!r}: suffix {p.suffix!r}, allowed one of {list(PLOT_SUFFIXES)} "
                                "(or none: .png is added)")
    check_output_file(p, "--plot")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UmallocValueError("--plot needs matplotlib (pip install matplotlib)") from None
    return p


def available_memory_bytes() -> int:
    """Bytes of host memory the kernel reports available (``MemAvailable``), else the physical memory."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_memory(needs: dict[str, int], hint: str) -> None:
    """Refuse a run whose host buffers (``needs``: what -> bytes) exceed :func:`available_memory_bytes`.

    Raises:
        UmallocValueError: naming each buffer, the sum, the available bytes and ``hint``.
    """
    total = sum(needs.values())
    have = available_memory_bytes()
    if total > have:
        parts = ", ".join(f"{k} {v:,}" for k, v in needs.items())
        raise UmallocValueError(f"the replay needs {total:,} bytes of host memory ({parts}) but this machine has "
                                f"{have:,} bytes available: allowed {hint}")


__all__ = ["DEFAULT_PLOT_NAME", "PLOT_SUFFIXES", "SNIFF_BYTES", "available_memory_bytes", "check_host_memory",
           "check_output_file", "check_trace_file", "resolve_plot_path"]
