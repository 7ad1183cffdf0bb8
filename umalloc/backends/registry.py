"""The registration multiset of one backend and the engine regions it normalises to (F21).

Policy:

* Callers register :class:`~umalloc.geometry.region.Region` s; the :class:`Registry` keeps them as a multiset
  (a region registered twice counts twice). The engine holds exactly ``normalize_regions(distinct registered
  regions)``: identical regions register once (refcounted), overlapping or touching regions of one device and
  memory kind merge into their union, regions sharing a base but with different lengths are two entries of the
  multiset (deregistering one leaves the other's bytes registered), and regions of different device/kind never
  fold.
* ``deregister`` must balance ``register``: more deregistrations than registrations raise
  :class:`~umalloc.errors.RegistrationError` and change nothing. A change that would drop or merge an engine
  region is refused while a transfer is pending or draining (an engine may still touch that memory).
* Only memory an engine can address is taken: a region on a device other than ``cpu`` / ``cuda`` / ``cuda:N``
  (``meta`` tensors have no memory) or at address 0 raises RegistrationError before any engine call.
* An engine call that fails midway is rolled back: the engine regions are what they were before the call.
* The caller keeps registered memory alive until it is deregistered (engines read and write it by address).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable

from umalloc.errors import InvariantError, RegistrationError
from umalloc.geometry.region import Region, normalize_regions
from umalloc.transfer.descriptors import region_ranges

#: Devices whose memory an engine can address.
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def validate_regions(regions: object, check_region: Callable[[Region], None]) -> list[Region]:
    """``regions`` (a Region or an iterable of them) as a list, each checked: a Region, addressable memory
    (device ``cpu`` / ``cuda`` / ``cuda:N``, base address not 0), and ``check_region`` (the engine's own
    refusal). O(R).

    Raises:
        RegistrationError: naming the first bad region; nothing changed.

    >>> validate_regions(Region(4096, 64), lambda r: None)
    [Region(base_ptr=4096, nbytes=64, device='cpu', mem_kind='DRAM')]
    >>> validate_regions([Region(0, 64, "meta")], lambda r: None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    umalloc.errors.RegistrationError: region Region(...): device 'meta' has no addressable memory; allowed ...
    """
    if isinstance(regions, Region):
        out = [regions]
    else:
        try:
            out = list(regions)  # type: ignore[call-overload]
        except TypeError:
            raise RegistrationError(f"regions={regions!r}: allowed a Region or an iterable of Region") from None
    for r in out:
        if not isinstance(r, Region):
            raise RegistrationError(f"region {r!r}: allowed umalloc.geometry.region.Region")
        if not isinstance(r.device, str) or _DEVICE.fullmatch(r.device) is None:
            raise RegistrationError(f"region {r}: device {r.device!r} has no addressable memory; allowed 'cpu', "
                                    "'cuda' or 'cuda:N'")
        if r.base_ptr == 0:
            raise RegistrationError(f"region {r}: base address 0 (a null pointer) is not registrable memory")
        check_region(r)
    return out


class Registry:
    """Caller registrations (a multiset) and the engine regions they normalise to.

    Args:
        engine_register: ``engine_register(region)`` -> engine token; raises if the engine refuses.
        engine_deregister: ``engine_deregister(region, token)``.

    Attributes:
        counts: each caller region with its outstanding registration count (all > 0).
        engine: engine-registered (normalised) region -> its engine token.
        regions: the engine regions sorted by ``(base_ptr, nbytes)``; ``starts`` / ``ends``: their byte ranges
            as ``uint64`` arrays (for :func:`~umalloc.transfer.descriptors.locate`).
    """

    def __init__(self, engine_register: Callable[[Region], object],
                 engine_deregister: Callable[[Region, object], None]) -> None:
        self._register = engine_register
        self._deregister = engine_deregister
        self.counts: Counter[Region] = Counter()
        self.engine: dict[Region, object] = {}
        self.regions: tuple[Region, ...] = ()
        self.starts, self.ends = region_ranges(())

    def added(self, regs: Iterable[Region]) -> Counter[Region]:
        """The multiset after registering ``regs`` once more each (nothing applied)."""
        new = self.counts.copy()
        new.update(regs)
        return new

    def removed(self, regs: Iterable[Region]) -> Counter[Region]:
        """The multiset after deregistering ``regs`` (nothing applied).

        Raises:
            RegistrationError: a region registered fewer times than asked.
        """
        need = Counter(regs)
        for r, k in need.items():
            have = self.counts.get(r, 0)
            if have < k:
                raise RegistrationError(f"deregister {r}: registered {have} time(s), asked to deregister {k}")
        return self.counts - need

    def apply(self, new_counts: Counter[Region], busy: int, backend: str) -> bool:
        """Make ``new_counts`` the registrations and bring the engine regions to their normalisation. Returns
        True when the engine region set changed. O(R log R) plus one engine call per changed region.

        Args:
            busy: transfers pending or draining; a change that drops or merges an engine region is refused
                while it is not 0.
            backend: the backend's name (for messages).

        Raises:
            RegistrationError: refused while busy, or the engine refused (rolled back: nothing changed).
        """
        target = {rr.region for rr in normalize_regions(new_counts.keys())}
        current = set(self.engine)
        to_remove = sorted(current - target)
        to_add = sorted(target - current)
        if to_remove and busy:
            raise RegistrationError(
                f"registration change drops or merges {len(to_remove)} engine region(s) while "
                f"{busy} transfer(s) are pending or draining: wait for them first")
        removed: list[tuple[Region, object]] = []
        added: list[Region] = []
        try:
            for r in to_remove:
                tok = self.engine[r]
                self._deregister(r, tok)
                del self.engine[r]
                removed.append((r, tok))
            for r in to_add:
                self.engine[r] = self._register(r)
                added.append(r)
        except Exception as e:
            for r in added:  # roll back to the state before the call
                try:
                    self._deregister(r, self.engine.pop(r))
                except Exception:  # pragma: no cover - best effort
                    pass
            for r, _ in removed:
                try:
                    self.engine[r] = self._register(r)
                except Exception:  # pragma: no cover
                    pass
            self._refresh()
            if isinstance(e, RegistrationError):
                raise
            raise RegistrationError(f"{backend}: engine registration failed: {e}") from e
        self.counts = +new_counts
        self._refresh()
        return bool(to_remove or to_add)

    def drop_all(self) -> None:
        """Deregister every engine region, best effort, and forget every registration (``close``)."""
        for r, tok in list(self.engine.items()):
            try:
                self._deregister(r, tok)
            except Exception:  # pragma: no cover - best effort on close
                pass
        self.engine.clear()
        self.counts.clear()
        self._refresh()

    def _refresh(self) -> None:
        self.regions = tuple(sorted(self.engine, key=lambda r: (r.base_ptr, r.nbytes)))
        self.starts, self.ends = region_ranges(self.regions)

    def check_invariants(self) -> None:
        """O(R log R): counts positive, engine regions exactly the normalised registrations, cached ranges
        current. Raises InvariantError naming the broken invariant."""
        if any(k <= 0 for k in self.counts.values()):
            raise InvariantError("registration counts must be positive")
        want = {rr.region for rr in normalize_regions(self.counts.keys())}
        if want != set(self.engine):
            raise InvariantError(f"engine regions {sorted(self.engine)} != normalised registrations {sorted(want)}")
        if set(self.regions) != set(self.engine):
            raise InvariantError("cached local region ranges out of date")
