"""`flyserve demo`: a real vLLM server on CPU, the sidecar beside it, traffic, a threshold change and advice."""
