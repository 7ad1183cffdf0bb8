"""The page pool: heap (every host array and the root), kernels/ (numba; pointer intrinsics only in kernels/raw),
placement, ladder (shortfall planning, pure), compaction, pagestate (page-state codes) and mirror (the CUDA v2p
mirrors)."""
