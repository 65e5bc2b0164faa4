"""`flyserve explain`: why one batch shape went to the path it did (the pure core is flyserve.policy.explain)."""
