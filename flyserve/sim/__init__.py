"""`flyserve simulate`: rank processes that play a vLLM engine without vLLM (for the sidecar, dashboards, tests)."""
