"""What a compile check refuses with: a typed error the command prints as its message."""

from __future__ import annotations


class CompileCheckError(ValueError):
    """Bad arguments or a machine that cannot run the check; the message names what and the fix."""
