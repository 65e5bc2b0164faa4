"""`flyserve arms`: compare two serving arms token by token (see docs/arms.md)."""
