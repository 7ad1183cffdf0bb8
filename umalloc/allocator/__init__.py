"""The allocator facade (facade) over the pool and the lease table, with its translation, space, freeing and
leasing parts; arguments turns ids and ``out=`` buffers into kernel arguments and returns read-only tables; observe holds the stats schema and snapshots; retraction moves a
request's bytes to host memory and back."""
