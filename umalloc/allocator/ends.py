"""End names to the indices the kernels take, for every service of the allocator facade.

* An :class:`EndIndex` is built once per allocator from its :class:`~umalloc.pool.heap.Heap` and never changes:
  end names in spec order, the id owners, each owner's group (the owner, then its bound ends), the bound ends.
* Every lookup validates the name it is given and raises :class:`~umalloc.errors.UmallocValueError` naming the
  allowed ones; nothing else in the allocator resolves a name.
* ``default_owner`` / ``default_mask`` are the one owner and its full bind mask when the arena has exactly one id
  owner (``-1`` otherwise): the allocation hot paths test them instead of calling :meth:`EndIndex.resolve`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from umalloc.errors import UmallocValueError
from umalloc.pool.heap import Heap


class EndIndex:
    """Name -> index lookups of one allocator's ends (read-only after construction; any thread). O(1) each
    unless stated.

    Attributes:
        names: end names in spec order. index: name -> index. owners: indices of the id-owner ends.
        group: owner index -> (owner, its bound ends...). bound: bound end name -> index.
        default_owner, default_mask: the only owner and the ``h8`` offset of its full bind mask, or ``-1``.
    """

    __slots__ = ("_heap", "bound", "default_mask", "default_owner", "group", "index", "names", "owners")

    def __init__(self, heap: Heap) -> None:
        self._heap = heap
        self.names: tuple[str, ...] = heap.names
        self.index: dict[str, int] = dict(heap.index)
        self.owners: tuple[int, ...] = heap.owners
        self.group: dict[int, tuple[int, ...]] = heap.group
        self.bound: dict[str, int] = {n: i for i, n in enumerate(self.names) if heap.owner_of(i) != i}
        single = len(self.owners) == 1
        self.default_owner = self.owners[0] if single else -1
        self.default_mask = heap.bind_mask(self.owners[0], None) if single else -1

    def end(self, name: str) -> int:
        """Index of end ``name``. Raises UmallocValueError for an unknown name."""
        try:
            return self.index[name]
        except (KeyError, TypeError):
            raise UmallocValueError(f"end {name!r}: allowed one of {list(self.names)}") from None

    def owner_name(self, e: int) -> str:
        """Name of end ``e``'s id owner."""
        return self.names[self._heap.owner_of(e)]

    def owner(self, name: str | None) -> int:
        """Index of id-owner end ``name`` (``None``: the only one). Raises UmallocValueError for an ambiguous
        ``None``, an unknown end or a bound end."""
        if name is None:
            if self.default_owner < 0:
                raise UmallocValueError(
                    f"owner=None is ambiguous: this arena has id-owner ends "
                    f"{[self.names[o] for o in self.owners]}; pass owner=")
            return self.default_owner
        o = self.end(name)
        if self._heap.owner_of(o) != o:
            raise UmallocValueError(f"owner={name!r} is bound to {self.owner_name(o)!r}; allowed an id-owner "
                                    f"end: {[self.names[i] for i in self.owners]}")
        return o

    def bound_end(self, name: str, where: str) -> int:
        """Index of bound end ``name``. Raises UmallocValueError (naming ``where``) for an unknown or owner end."""
        b = self.end(name)
        if self._heap.owner_of(b) == b:
            raise UmallocValueError(f"{where}: end {name!r} is an id-owner end; allowed a bound end: "
                                    f"{list(self.bound)}")
        return b

    def bind_mask(self, o: int, bind: Iterable[str] | None, *, only: int = -1) -> int:
        """Offset in ``h8`` of the bind mask of owner ``o`` (:meth:`umalloc.pool.heap.Heap.bind_mask`)."""
        return self._heap.bind_mask(o, bind, only=only)

    def resolve(self, owner: str | None, bind: Sequence[str] | None) -> tuple[int, int]:
        """``(owner index, bind mask offset)`` of an allocation's ``owner=`` and ``bind=`` arguments."""
        if owner is None and bind is None and self.default_owner >= 0:
            return self.default_owner, self.default_mask
        o = self.owner(owner)
        return o, self.bind_mask(o, bind)


__all__ = ["EndIndex"]
