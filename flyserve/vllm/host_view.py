"""HostView: numpy views of a prefix of one of vLLM's persistent CPU buffers, kept across steps.

vLLM's model runner hands the attention builders prefix slices of buffers it allocates once
(``query_start_loc_cpu = self.query_start_loc.cpu[: num_reqs_padded + 1]``,
``seq_lens_cpu_upper_bound = self.optimistic_seq_lens_cpu[:num_reqs_padded]``): a new tensor
object every step, over the same memory, rewritten in place. ``tensor.numpy()`` per step cost
0.75-1.7 us on the 2-core CI VM; slicing a kept view of the longest prefix seen costs about 0.3 us
with the checks below (timeit).

A kept view is used only when the tensor starts at the same address, has the same dtype, is
contiguous, and ``n`` is within the view: then the tensor's first ``n`` elements are the view's
first ``n``, whatever was written there since. Anything else (another buffer, a longer prefix) takes
``.numpy()`` once and replaces the view; a strided tensor is read through ``.numpy()`` every time
and never kept. The kept tensor holds its memory alive, so the address cannot be reused by another
allocation.

The caller promises ``n <= len(tensor)`` (vLLM's ``num_reqs <= num_reqs_padded``): the length of
the tensor is not checked on the fast path (one more attribute read per step), so a tensor shorter
than ``n`` could be read past its end through a kept view of a longer one. Conjugate and negative
views (``torch._neg_view``) are not told apart either; vLLM passes neither.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class HostView:
    """``view(tensor, n)``: ``tensor[:n]`` (``n <= len(tensor)``) as numpy, without a ``.numpy()``
    call per step; ``lens(tensor, n)``: the ``n`` row lengths of a ``query_start_loc`` prefix.

    Methods, not ``__call__``: calling an instance through ``__call__`` cost 0.25 us more than a
    bound method on CPython 3.11 (timeit)."""

    __slots__ = ("_a0", "_a1", "_array", "_dtype", "_pair_n", "_ptr", "_size", "_tensor")

    def __init__(self) -> None:
        self._ptr = -1
        self._size = -1
        self._dtype: Any = None
        self._array: np.ndarray = np.empty(0)
        self._tensor: Any = None  # keeps the buffer's memory alive while the view is kept
        self._pair_n = -1  # lens(): the n whose two shifted slices are kept
        self._a1: np.ndarray = self._array
        self._a0: np.ndarray = self._array

    def view(self, t: Any, n: int) -> np.ndarray:
        if t.data_ptr() == self._ptr and n <= self._size and t.dtype is self._dtype and t.is_contiguous():
            return self._array[:n]
        a = t.numpy()
        if a.ndim == 1 and a.strides[0] == a.itemsize:  # contiguous: a later prefix is a prefix
            self._ptr, self._size, self._dtype, self._array, self._tensor = (
                t.data_ptr(),
                a.size,
                t.dtype,
                a,
                t,
            )
            self._pair_n = -1
        return a[:n]

    def lens(self, t: Any, n: int) -> np.ndarray:
        """``t[1:n+1] - t[:n]`` as a new numpy array (``n + 1 <= len(t)``): one subtraction of two
        slices kept for this ``n`` (a serving batch keeps its row count for many steps), instead of a
        view and two slices per step (0.3 us on the CI VM)."""
        if t.data_ptr() == self._ptr and t.dtype is self._dtype and t.is_contiguous():
            if n == self._pair_n:
                return self._a1 - self._a0
            if n < self._size:
                a = self._array
                self._a1 = a1 = a[1 : n + 1]
                self._a0 = a0 = a[:n]
                self._pair_n = n
                return a1 - a0
        a = self.view(t, n + 1)
        return a[1:] - a[:-1]
