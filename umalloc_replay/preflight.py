"""Checks ``umalloc replay`` and ``umalloc generate`` run before anything else: input and output paths, and
host memory.

Policy:

* Every check raises :class:`~umalloc.errors.UmallocValueError` with one line naming the option, the value and
  what is allowed; nothing is created, written or allocated by a failed check (an output folder's writability
  is probed with a temporary file that is removed at once).
* An output path (``--report``, ``--plot``) must name neither an input (``--trace``) nor another output, also
  through a link or another spelling (:func:`check_distinct_paths`): a run never writes over its own trace.
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
import importlib.util
import os
import re
import tempfile
from fractions import Fraction
from pathlib import Path

from umalloc import UmallocValueError

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


def same_file(a: str | Path, b: str | Path) -> bool:
    """True if paths ``a`` and ``b`` name one file: :func:`os.path.samefile` when both exist (a link, a hard link
    or another spelling of the same file), else equal absolute paths after resolving links. O(1) system calls."""
    pa, pb = Path(a), Path(b)
    try:
        if pa.exists() and pb.exists():
            return os.path.samefile(pa, pb)
    except OSError:
        pass
    return pa.resolve() == pb.resolve()


def check_distinct_paths(inputs: dict[str, str | Path | None], outputs: dict[str, str | Path | None]) -> None:
    """Refuse an output path that is an input file or another output (``option -> path``; ``None``: not given),
    so a run never writes over its own trace or writes two outputs into one file (:func:`same_file`).

    Raises:
        UmallocValueError: naming both options and the path.
    """
    outs = [(o, p) for o, p in outputs.items() if p is not None]
    for i, (opt, path) in enumerate(outs):
        for other, given in [*((k, v) for k, v in inputs.items() if v is not None), *outs[:i]]:
            if same_file(path, given):  # type: ignore[arg-type]
                raise UmallocValueError(f"{opt} {str(path)!r} and {other} name the same file: allowed an {opt} "
                                        f"path other than {other}'s")


def resolve_plot_path(path: str | Path, default_name: str = DEFAULT_PLOT_NAME) -> Path:
    """The file ``--plot PATH`` writes: ``PATH`` itself with a suffix of :data:`PLOT_SUFFIXES`, ``PATH.png``
    without a suffix, ``PATH/default_name`` for an existing directory; checked writable
    (:func:`check_output_file`) and matplotlib importable.

    Raises:
        UmallocValueError: an empty path or a file name ending in a dot, another suffix, an unwritable path, or no
            matplotlib.

    >>> resolve_plot_path("/tmp/occupancy").name, resolve_plot_path("/tmp").name
    ('occupancy.png', 'umalloc-replay.png')
    """
    p = Path(path)
    if str(path).strip() == "" or (str(path).endswith(".") and not p.is_dir()):
        raise UmallocValueError(f"--plot {str(path)!r}: allowed a file name (a .png, .pdf or .svg suffix, or none: "
                                ".png is added) or a folder")
    if p.is_dir():
        p = p / default_name
    elif p.suffix == "":
        p = p.with_name(p.name + ".png")
    elif p.suffix.lower() not in PLOT_SUFFIXES:
        raise UmallocValueError(f"--plot {str(path)!r}: suffix {p.suffix!r}, allowed one of {list(PLOT_SUFFIXES)} "
                                "(or none: .png is added)")
    check_output_file(p, "--plot")
    if importlib.util.find_spec("matplotlib") is None:  # found, not imported: a refusal stays quick
        raise UmallocValueError("--plot needs matplotlib (pip install matplotlib)")
    return p


_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]i?[bB]?|[bB])?\s*$")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "ki": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "mi": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "gi": 2**30, "t": 10**12,
          "tb": 10**12, "tib": 2**40, "ti": 2**40}


def parse_size_bytes(text: str) -> int:
    """``"3GiB"`` -> 3221225472; plain ints are bytes; ``k/M/G/T`` are decimal, ``Ki/Mi/Gi/Ti`` binary.

    The value is exact (no float rounding) and must be a whole, positive number of bytes.

    Raises:
        UmallocValueError: not a size, zero, or a fraction of a byte (``"0.5"``, ``"1.5"``).

    >>> parse_size_bytes("1536MiB"), parse_size_bytes("2GB"), parse_size_bytes("4096"), parse_size_bytes("4.1GB")
    (1610612736, 2000000000, 4096, 4100000000)
    """
    m = _SIZE_RE.match(text)
    if m is None:
        raise UmallocValueError(f"size {text!r}: allowed an int or a number with a unit (e.g. 512MiB, 2GiB)")
    nbytes = Fraction(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if nbytes.denominator != 1 or nbytes < 1:
        raise UmallocValueError(f"size {text!r} is {float(nbytes):g} bytes: allowed a whole number of bytes >= 1")
    return int(nbytes)


def parse_arena_bytes(text: str) -> tuple[int, int]:
    """``"SIZE"`` (both arenas) or ``"PREFILL,DECODE"`` -> ``(prefill_bytes, decode_bytes)``.

    Raises:
        UmallocValueError: not one or two sizes (see :func:`parse_size_bytes`).

    >>> parse_arena_bytes("1GiB,3GiB")
    (1073741824, 3221225472)
    """
    parts = text.split(",")
    if len(parts) not in (1, 2):
        raise UmallocValueError(f"--arena-bytes {text!r}: allowed SIZE or PREFILL,DECODE")
    try:
        sizes = [parse_size_bytes(p) for p in parts]
    except UmallocValueError as exc:
        raise UmallocValueError(f"--arena-bytes: {exc}") from None
    return (sizes[0], sizes[-1])


#: Environment variable that, when set, is the host memory :func:`available_memory_bytes` reports (bytes or a
#: size such as ``64GiB``): the test suite sets it so that no test depends on the memory free on its machine.
HOST_MEMORY_ENV = "UMALLOC_HOST_MEMORY_BYTES"


def available_memory_bytes() -> int:
    """Bytes of host memory the replay may use: ``$UMALLOC_HOST_MEMORY_BYTES`` when set, else what the kernel
    reports available (``MemAvailable``), else the physical memory.

    Raises:
        UmallocValueError: ``$UMALLOC_HOST_MEMORY_BYTES`` is not a size.
    """
    given = os.environ.get(HOST_MEMORY_ENV, "").strip()
    if given:
        try:
            return parse_size_bytes(given)
        except UmallocValueError as exc:
            raise UmallocValueError(f"${HOST_MEMORY_ENV}: {exc}") from None
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
                                f"{have:,} bytes available: pass {hint}")


def is_multi_rank(prefill_tp: int, decode_tp: int, prefill_dcp: int, decode_dcp: int,
                  prefill_page_size: int | None, page_size: int) -> bool:
    """True if these sizes need the multi-rank replay (any TP or DCP other than 1, or a prefill page size that
    differs from the decode one).

    >>> is_multi_rank(1, 1, 1, 1, None, 16), is_multi_rank(1, 1, 1, 1, 32, 16), is_multi_rank(2, 1, 1, 1, None, 16)
    (False, True, True)
    """
    return (prefill_tp, decode_tp, prefill_dcp, decode_dcp) != (1, 1, 1, 1) or \
        (prefill_page_size is not None and prefill_page_size != page_size)


__all__ = ["DEFAULT_PLOT_NAME", "HOST_MEMORY_ENV", "PLOT_SUFFIXES", "SNIFF_BYTES", "available_memory_bytes",
           "check_distinct_paths", "check_host_memory", "check_output_file", "check_trace_file", "is_multi_rank",
           "parse_arena_bytes", "parse_size_bytes", "resolve_plot_path", "same_file"]
