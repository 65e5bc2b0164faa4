"""Hardened file access shared by control, sidecar, telemetry and the tools: reading a file an
attacker may have planted (safe_read), writing one a reader may see mid-write (atomic), asking the
process table whether a pid lives (processes). Imports nothing of flyserve."""
