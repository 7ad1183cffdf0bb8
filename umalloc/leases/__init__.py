"""Leases: the lease table, lease states (active, released, expired, in doubt, settled) and generations."""
