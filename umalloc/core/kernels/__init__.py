"""The numba layer of the allocator core, fenced in.

* :mod:`~umalloc.core.kernels.raw`: the only module with pointer intrinsics (its opening comment states the
  rules: who owns each array, when addresses may change, what a caller must guarantee).
* :mod:`~umalloc.core.kernels.layout`: the heap's column and code constants.
* :mod:`~umalloc.core.kernels.bitmap`: hole and free-id bitmaps.
* :mod:`~umalloc.core.kernels.placement`: band planning and page placement.
* :mod:`~umalloc.core.kernels.ops`: the kernel entry points and their compiled direct entries.
* :mod:`~umalloc.core.kernels.codes`: result codes and their decoding into typed errors.
"""
