"""The allocator core: heap (every array and the root), kernels/ (numba; pointer intrinsics only in kernels/raw),
ladder (shortfall planning, pure), compaction, leases, retraction, and the allocator facade (allocator, with its
translation, space and leasing parts; ids validates at the boundary; observe holds stats, views and invariants;
mirror keeps the CUDA v2p mirrors)."""
