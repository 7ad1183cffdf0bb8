"""Leases: the lease handle and its states (lease), the lease table with pin counts, expiry, the in-doubt rule and generations (table)."""
