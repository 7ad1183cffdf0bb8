"""The public face ``umalloc/__init__.py``: the lazy export table, ``__all__`` and the imports a type checker
reads under ``TYPE_CHECKING`` name the same objects; internals stay importable from their modules only; the
typed snippets file (``readme_snippets.py``, checked by mypy in ``scripts/test.sh``) runs."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import readme_snippets

import umalloc
from umalloc.geometry.presets import preset_arena_spec

INIT = Path(umalloc.__file__)

#: names that live in their modules only (each: the module that defines it)
INTERNAL = {
    "LeaseTable": "umalloc.leases.table",
    "EndView": "umalloc.pool.views",
    "snapshots_equal": "umalloc.allocator.observe",
    "ReadOnlyTable": "umalloc.allocator.arguments",
    "HeapCopyError": "umalloc.errors",
    "PAGE_RESERVED": "umalloc.pool.pagestate",
    "PAGE_GAP": "umalloc.pool.pagestate",
    "PAGE_HOLE": "umalloc.pool.pagestate",
    "PAGE_LIVE": "umalloc.pool.pagestate",
    "PAGE_PENDING": "umalloc.pool.pagestate",
}


def _type_checking_imports() -> dict[str, str]:
    """name -> module of every ``from X import name`` under ``if TYPE_CHECKING:`` in umalloc/__init__.py."""
    out: dict[str, str] = {}
    for node in ast.parse(INIT.read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module, ast.dump(imp)
                out.update((a.asname or a.name, imp.module) for a in imp.names)
    return out


def test_export_table_all_and_type_checking_imports_agree() -> None:
    exports = umalloc._EXPORTS
    assert umalloc.__all__ == sorted(exports)
    assert _type_checking_imports() == exports


def test_every_export_resolves_to_its_module_object() -> None:
    for name, module in umalloc._EXPORTS.items():
        assert getattr(umalloc, name) is getattr(importlib.import_module(module), name), name


def test_the_transfer_side_is_exported() -> None:
    from umalloc.backends import get_backend
    from umalloc.errors import BackendError, IncompatiblePeerError, TransferError, TransferTimeout
    from umalloc.transfer import PeerLayout, TransferPlan, build_plan, build_receiver_half

    assert (umalloc.build_plan, umalloc.build_receiver_half, umalloc.PeerLayout, umalloc.TransferPlan,
            umalloc.get_backend) == (build_plan, build_receiver_half, PeerLayout, TransferPlan, get_backend)
    assert (umalloc.BackendError, umalloc.TransferError) == (BackendError, TransferError)
    # the finer transfer errors live in umalloc.errors only (umalloc.__all__ holds what an adapter catches first)
    assert all(not hasattr(umalloc, n) for n in ("IncompatiblePeerError", "TransferTimeout"))
    assert issubclass(IncompatiblePeerError, umalloc.UmallocError) and issubclass(TransferTimeout, TransferError)


def test_the_public_face_is_small() -> None:
    """What an engine or a transfer adapter needs, at most 40 names; the app imports the rest from subpackages."""
    assert len(umalloc.__all__) <= 40, len(umalloc.__all__)


def test_internals_are_not_exported_but_stay_importable() -> None:
    for name, module in INTERNAL.items():
        assert name not in umalloc.__all__ and name not in umalloc._EXPORTS, name
        assert not hasattr(umalloc, name), name
        assert hasattr(importlib.import_module(module), name), (name, module)
    assert not hasattr(umalloc, "OutOfPages") and not hasattr(umalloc.errors, "OutOfPages")


def test_the_typed_snippets_run() -> None:
    # README.md's example frees everything it allocated: 0 live pages on every end; at the peak request 0 held
    # 41 tokens (3 pages of 16) and request 1 8 tokens (1 page) on each of full, swa and draft
    assert readme_snippets.token_ids() == {"full": (0, 4), "swa": (0, 4), "draft": (0, 4)}
    # docs/usage.md's page-level example: pages 1, 2, 3 to slots 0-2 and 4, 5 to slots 8, 9, then slots 8, 9
    # freed (the table keeps them)
    assert readme_snippets.page_ids() == [[1, 2, 3, 0, 0, 0, 0, 0], [4, 5, 0, 0, 0, 0, 0, 0]]
    # its request-table example: the child holds 16 tokens, request 1 8 tokens
    tokens, held_pages, cached_pages = readme_snippets.request_table()
    assert tokens == [16, 8]
    assert cached_pages == 1
    assert held_pages >= 2
    nbytes, same = readme_snippets.transfer_plan()
    spec = preset_arena_spec("gemma-3-12b-draft", arena_bytes=64 << 20, page_size=16)
    full = next(e for e in spec.ends if e.name == "full")
    assert same and nbytes >= 3 * full.page_bytes  # at least the 3 full-attention pages of 40 tokens moved


def test_every_exception_of_umalloc_errors_is_a_umalloc_error() -> None:
    """One base class catches every umalloc exception, a broken invariant included; ``InvariantError`` stays an
    ``AssertionError`` too, so a check that expects an assertion still sees one."""
    import inspect

    from umalloc import errors

    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, BaseException) and c.__module__ == errors.__name__]
    assert len(classes) > 10, classes
    assert [c.__name__ for c in classes if not issubclass(c, errors.UmallocError)] == []
    assert issubclass(errors.InvariantError, AssertionError)
    assert not issubclass(errors.InvariantError, errors.UmallocValueError)   # a bug, never a refused call
