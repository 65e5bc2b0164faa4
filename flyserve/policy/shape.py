"""BatchShape: the host-side numbers of one engine step that the dispatch rules read.

Built once per engine step per rank from vLLM's ``query_start_loc_cpu`` (already on the
host: no device read). One diff of the prefix sums gives the row lengths; everything else
is a vectorised reduction, never a Python loop over rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from flyserve.policy.thresholds import Thresholds

# The seed's defaults, used when no Thresholds is given (kept equal to Thresholds' defaults;
# tests/unit/test_policy_shape_thresholds.py checks that).
_DEFAULT_DECODE_QUERY_LEN_MAX = 1
_DEFAULT_BLOCK_M = 256
# from_step counts the rows of a batch this small in Python rather than numpy (see there).
FEW_ROWS = 8
# tuple.__new__(BatchShape, values): the NamedTuple's generated __new__ is a Python frame around
# this call (0.61 us against 0.24 us to build one shape, timeit on the CI VM).
_new = tuple.__new__
# 0-d int32 arrays of the decode_query_len_max values seen: comparing an int32 row array with one
# costs 0.37 us against 0.65 us with a Python int (numpy converts and promotes the int per call;
# timeit, 256 rows, CI VM). Values are few (one per thresholds version); the dict stays tiny.
_BOUND_0D: dict[int, np.ndarray] = {}


def int_bound(v: int) -> np.ndarray:
    """``v`` as a 0-d int32 array (int64 or wider if it does not fit), for comparing row arrays."""
    b = _BOUND_0D.get(v)
    if b is None:
        if len(_BOUND_0D) > 64:
            _BOUND_0D.clear()
        b = np.array(v, dtype=np.int32) if -(2**31) <= v < 2**31 else np.array(v)
        b.flags.writeable = False  # shared by every caller: a stray in-place write would skew every count
        _BOUND_0D[v] = b
    return b


def _as_int_array(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    numpy = getattr(x, "numpy", None)  # a CPU torch tensor, without importing torch
    if numpy is not None:
        return numpy()
    return np.asarray(x)


class BatchShape(NamedTuple):
    """One batch, as the dispatcher sees it. Immutable.

    A NamedTuple rather than a frozen dataclass because it is built once per engine step on the
    hot path: construction costs 0.36 us against 1.31 us for a frozen slotted dataclass of the same
    eight fields (timeit on the 2-core CI VM).

    num_decode_rows: rows with query_len <= decode_query_len_max.
    num_short_query_rows: rows with query_len < block_m (decode rows included): rows that
    fill less than one q-block of the prefill kernel, which the LPT ordering cares about; -1 when
    not counted (``from_step`` on a step with a row of block_m or more: see there).
    Zero-length rows (CUDA-graph padding) count as decode and short rows; vLLM pads only
    uniform-decode batches, which take decode_path before any of these counts are read.
    """

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    num_heads: int
    causal: bool
    num_decode_rows: int
    num_short_query_rows: int

    @classmethod
    def from_query_lens(
        cls,
        query_lens: Any,
        *,
        max_seq_len: int,
        num_heads: int,
        causal: bool = True,
        thresholds: Thresholds | None = None,
    ) -> BatchShape:
        """From per-row query lengths (a sequence, numpy array or CPU tensor)."""
        lens = _as_int_array(query_lens)
        return cls._from_lens(lens, int(lens.sum()), max_seq_len, num_heads, causal, thresholds)

    @classmethod
    def from_query_start_loc(
        cls,
        qsl: Any,
        *,
        max_seq_len: int,
        num_heads: int,
        causal: bool = True,
        thresholds: Thresholds | None = None,
    ) -> BatchShape:
        """From vLLM's ``query_start_loc_cpu`` (num_reqs + 1 prefix sums; numpy or CPU tensor)."""
        a = _as_int_array(qsl)
        # np.diff(a), written as a slice difference: the same array, and on a 257-entry
        # query_start_loc about 4x cheaper (0.7 us vs 3.2 us, measured on the 2-core CI VM),
        # because np.diff's Python-level argument handling dominates at this size.
        lens = a[1:] - a[:-1]
        return cls._from_lens(
            lens, int(a[-1] - a[0]) if a.size else 0, max_seq_len, num_heads, causal, thresholds
        )

    @classmethod
    def from_step(
        cls,
        qsl: Any,
        num_reqs: int,
        num_actual_tokens: int,
        max_query_len: int,
        max_seq_len: int,
        num_heads: int,
        causal: bool,
        decode_query_len_max: int,
        block_m: int,
    ) -> BatchShape:
        """From one engine step's host ints (vLLM's ``num_reqs``, ``num_actual_tokens``,
        ``max_query_len``, ``max_seq_len``) and ``query_start_loc_cpu`` (numpy or CPU tensor),
        read only for a row count that ``max_query_len`` does not already give, and only its first
        ``num_reqs + 1`` entries (vLLM's slice runs to ``num_reqs_padded + 1``).

        Positional, for the hot path (keyword arguments cost a measurable share of a microsecond
        here). Equal to ``from_query_start_loc`` when the ints describe the same rows (vLLM pads
        ``num_actual_tokens`` only on uniform-decode CUDA-graph steps, which the routing decides
        without a shape), except that the short-row count is left at -1 ("not counted") when
        ``max_query_len >= block_m``: only the LPT rule reads it, on the few steps that reach it,
        and it raises ShortRowsNotCounted rather than guess (``with_short_rows`` counts them).
        Every row is a decode row when ``max_query_len <= decode_query_len_max``: a decode-only
        step reads no array, a step of decode rows and chunks one comparison over the rows.
        """
        if num_reqs == 0:
            return _new(cls, (0, 0, 0, max_seq_len, num_heads, causal, 0, 0))
        short = num_reqs if max_query_len < block_m else -1
        if max_query_len <= decode_query_len_max:
            dec = num_reqs
        elif num_reqs <= FEW_ROWS:
            # A few rows: a Python loop over tolist() beats numpy's per-call cost and counts both
            # (2 rows: about 0.5 us against 2.5 us for .numpy() and one comparison, on the CI VM).
            dec = short = 0
            v = qsl[: num_reqs + 1].tolist()
            prev = v[0]
            for x in v[1:]:
                n = x - prev
                prev = x
                if n <= decode_query_len_max:
                    dec += 1
                if n < block_m:
                    short += 1
        else:
            a = (qsl if qsl.__class__ is np.ndarray else _as_int_array(qsl))[: num_reqs + 1]
            # int(): np.count_nonzero returns a numpy integer, and numpy scalars in the recorder's
            # float cells cost it 3.7 us a step instead of 1.2 (H200 host, timeit).
            b = _BOUND_0D.get(decode_query_len_max)
            if b is None:
                b = int_bound(decode_query_len_max)
            dec = int(np.count_nonzero((a[1:] - a[:-1]) <= b))
        return _new(
            cls, (num_reqs, num_actual_tokens, max_query_len, max_seq_len, num_heads, causal, dec, short)
        )

    def with_short_rows(self, qsl: Any, block_m: int) -> BatchShape:
        """This shape with ``num_short_query_rows`` counted from ``query_start_loc`` (a copy; its
        first ``num_reqs + 1`` entries)."""
        a = _as_int_array(qsl)[: self.num_reqs + 1]
        return self._replace(num_short_query_rows=int(np.count_nonzero((a[1:] - a[:-1]) < block_m)))

    @classmethod
    def _from_lens(
        cls,
        lens: np.ndarray,
        num_tokens: int,
        max_seq_len: int,
        num_heads: int,
        causal: bool,
        thresholds: Thresholds | None,
    ) -> BatchShape:
        if thresholds is None:
            dq, bm = _DEFAULT_DECODE_QUERY_LEN_MAX, _DEFAULT_BLOCK_M
        else:
            dq, bm = thresholds.decode_query_len_max, thresholds.block_m
        n = lens.size
        if n == 0:
            return cls(0, 0, 0, int(max_seq_len), int(num_heads), bool(causal), 0, 0)
        return cls(
            n,
            num_tokens,
            int(lens.max()),
            int(max_seq_len),
            int(num_heads),
            bool(causal),
            int(np.count_nonzero(lens <= dq)),
            int(np.count_nonzero(lens < bm)),
        )

    @property
    def num_prefill_rows(self) -> int:
        return self.num_reqs - self.num_decode_rows

    def num_q_blocks(self, block_m: int) -> int:
        """q-blocks of the longest row: ceil(max_query_len / block_m)."""
        return -(-self.max_query_len // block_m)
