"""`flyserve top`: a live terminal view of one sidecar's /dispatch-stats/stream, for someone on the node."""
