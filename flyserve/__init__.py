"""flyserve: observable, runtime-tunable dual-kernel attention dispatch for vLLM."""

__version__ = "0.1.0"
