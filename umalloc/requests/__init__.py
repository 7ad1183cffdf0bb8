"""The request table above the allocator: per-request page tables and extents (table) and page reference counts
with the cached-free LRU (refcounts)."""
