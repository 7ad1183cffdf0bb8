"""The allocator core: heap, kernels, shortfall ladder, compaction, leases, retraction and the allocator facade."""
