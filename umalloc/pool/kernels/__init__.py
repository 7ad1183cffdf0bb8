"""The numba layer of the allocator core, fenced in.

* :mod:`~umalloc.pool.kernels.raw`: the only module with pointer intrinsics (its opening comment states the
  rules: who owns each array, when addresses may change, what a caller must guarantee).
* :mod:`~umalloc.pool.kernels.layout`: the heap's column and code constants.
* :mod:`~umalloc.pool.kernels.bitmap`: hole and free-id bitmaps.
* :mod:`~umalloc.pool.kernels.placement`: band planning and page placement.
* :mod:`~umalloc.pool.kernels.ops`: the kernel entry points and their compiled direct entries.
* :mod:`~umalloc.pool.kernels.codes`: result codes and their decoding into typed errors.
"""
