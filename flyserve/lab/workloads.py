"""Batch-shape traces: what the attention layer sees, one engine step at a time.

Two sources:

* ``workload(name)`` / ``generate(spec)``: a deterministic simulation of vLLM's V1 chunked-prefill
  scheduler for a closed-loop benchmark (``concurrency`` clients, each sending its next request as
  soon as the last one finished, as ``vllm bench serve --max-concurrency`` does). The seed's A/B was
  run at the six named points below, so those are the traces the dispatch policy must do well on.
* ``load_trace(path)``: a shape log recorded from a real vLLM run (the routing writes it when
  ``FLYSERVE_SHAPE_LOG`` is set). Format below; ``shape_log_line`` writes one line of it.

The simulated scheduler (vllm/v1/core/sched/scheduler.py, with prefix caching off and the KV cache
assumed large enough; preemption is not modelled):

1. RUNNING requests first, in admission order: a request that has finished its prompt asks for one
   token (a decode row); one still in its prompt asks for the rest of it (a prefill chunk). Each
   takes ``min(wanted, token_budget)`` tokens; the budget starts at ``max_num_batched_tokens``.
2. Then WAITING requests (FIFO) while budget remains and fewer than ``max_num_seqs`` run: each
   takes ``min(prompt_len, token_budget)`` tokens (chunked prefill).
3. Rows are ordered decode rows first, then prefill chunks, as vLLM's attention metadata builders
   reorder a batch (``reorder_batch_threshold``).
4. A request samples one output token in the step its prompt completes and one per decode step
   after that; after ``output_len`` tokens it leaves, and its client's next request joins the
   waiting queue for the following step.

``seq_lens[i]`` is the row's context length INCLUDING its new query tokens (vLLM's ``seq_lens``).

Shape-log format (JSON Lines, one object per line, UTF-8):

* an optional header line: ``{"format": "flyserve-shape-log", "version": 1, ...}`` (any other
  keys are kept as the trace's metadata, e.g. ``num_heads``, ``block_size``, ``model``);
* one line per engine step: ``{"step": int, "query_lens": [int, ...], "seq_lens": [int, ...]}``,
  optionally ``"rank": int`` (a multi-rank log is filtered with ``load_trace(path, rank=0)``).
  ``query_lens`` and ``seq_lens`` have the same length; every query_len >= 0 and every
  seq_len >= its query_len. Blank lines are ignored.
"""

from __future__ import annotations

import json
import math
import random
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flyserve.files import safe_read

MAX_TRACE_BYTES = 1 << 30
"""A recorded shape log larger than 1 GiB is refused (an hour of a busy engine is ~100 MB)."""
SHAPE_LOG_FORMAT = "flyserve-shape-log"
SHAPE_LOG_VERSION = 1

DEFAULT_MAX_NUM_BATCHED_TOKENS = 32768
"""As in the seed's A/B (``--max-num-batched-tokens 32768``); 16384 is the other value it used."""
DEFAULT_BLOCK_SIZE = 16


class TraceError(ValueError):
    """A trace file or workload request was rejected; the message names the line and field."""


@dataclass(frozen=True, slots=True)
class TraceStep:
    """One engine step: per-row query lengths and context lengths (including the query)."""

    query_lens: np.ndarray
    seq_lens: np.ndarray

    @property
    def num_reqs(self) -> int:
        return int(self.query_lens.size)

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max()) if self.seq_lens.size else 0

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens.max()) if self.query_lens.size else 0

    @property
    def query_start_loc(self) -> np.ndarray:
        """vLLM's ``query_start_loc``: num_reqs + 1 prefix sums of query_lens."""
        out = np.zeros(self.query_lens.size + 1, dtype=np.int64)
        np.cumsum(self.query_lens, out=out[1:])
        return out


@dataclass(frozen=True)
class WorkloadSpec:
    """A closed-loop serving point, the inputs of the scheduler simulation.

    ``num_requests`` defaults to two waves (2 x concurrency), enough to include the second wave's
    prefill chunks mixed with the first wave's last decode rows. ``range_ratio`` > 0 draws each
    request's input and output length uniformly from [len*(1-r), len*(1+r)] with ``seed``, as
    ``vllm bench serve --random-range-ratio`` does; 0 (the default) gives exact lengths.
    """

    input_len: int
    output_len: int
    concurrency: int
    num_requests: int | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = 256
    range_ratio: float = 0.0
    seed: int = 0

    def validate(self) -> None:
        checks = [
            ("input_len", self.input_len >= 1, "must be >= 1"),
            ("output_len", self.output_len >= 1, "must be >= 1"),
            ("concurrency", self.concurrency >= 1, "must be >= 1"),
            ("num_requests", self.num_requests is None or self.num_requests >= 1, "must be >= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, "must be >= 1"),
            ("block_size", self.block_size >= 1, "must be >= 1"),
            ("max_num_seqs", self.max_num_seqs >= 1, "must be >= 1"),
            ("range_ratio", 0.0 <= self.range_ratio < 1.0, "must be in [0, 1)"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise TraceError(f"workload field '{name}': {why} (got {getattr(self, name)!r})")

    @property
    def requests(self) -> int:
        return self.num_requests if self.num_requests is not None else 2 * self.concurrency


@dataclass(frozen=True)
class Trace:
    """A named sequence of TraceSteps. Iterating yields the steps in order."""

    name: str
    steps: tuple[TraceStep, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[TraceStep]:
        return iter(self.steps)

    def __getitem__(self, i: int) -> TraceStep:
        return self.steps[i]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.steps)

    @property
    def max_seq_len(self) -> int:
        return max((s.max_seq_len for s in self.steps), default=0)

    def to_jsonl(self) -> str:
        """The trace in the shape-log format (header first), e.g. to save a generated workload."""
        header = {"format": SHAPE_LOG_FORMAT, "version": SHAPE_LOG_VERSION, "name": self.name, **self.meta}
        lines = [json.dumps(header, sort_keys=True)]
        lines += [shape_log_line(i, s.query_lens, s.seq_lens) for i, s in enumerate(self.steps)]
        return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- named workloads

SEED_WORKLOADS: dict[str, tuple[int, int, int]] = {
    # name: (input_len, output_len, concurrency): the seed's six serving points
    "seed-8k-c8": (8192, 1024, 8),
    "seed-8k-c32": (8192, 1024, 32),
    "seed-32k-c8": (32768, 1024, 8),
    "seed-32k-c32": (32768, 1024, 32),
    "seed-60k-c8": (61440, 600, 8),
    "seed-60k-c32": (61440, 600, 32),
}
# 8k/32k/60k are read as 8*1024, 32*1024 and 60*1024 tokens of prompt.


def workload_names() -> list[str]:
    return list(SEED_WORKLOADS)


def workload_spec(name: str, **overrides: Any) -> WorkloadSpec:
    if name not in SEED_WORKLOADS:
        raise TraceError(f"unknown workload {name!r} (known: {', '.join(SEED_WORKLOADS)})")
    i, o, c = SEED_WORKLOADS[name]
    unknown = set(overrides) - set(WorkloadSpec.__dataclass_fields__)
    if unknown:
        raise TraceError(f"unknown workload option(s): {', '.join(sorted(unknown))}")
    return WorkloadSpec(input_len=i, output_len=o, concurrency=c, **overrides)


def workload(
    name: str,
    *,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_requests: int | None = None,
    seed: int = 0,
    range_ratio: float = 0.0,
) -> Trace:
    """The named workload's trace (deterministic for a given name and arguments)."""
    spec = workload_spec(
        name,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        num_requests=num_requests,
        seed=seed,
        range_ratio=range_ratio,
    )
    return generate(spec, name=name)


# ----------------------------------------------------------------------------- the scheduler


@dataclass(slots=True)
class _Req:
    prompt_len: int
    output_len: int
    computed: int = 0  # tokens whose KV is in the cache
    generated: int = 0  # output tokens sampled so far


def _lengths(spec: WorkloadSpec) -> list[tuple[int, int]]:
    if spec.range_ratio == 0.0:
        return [(spec.input_len, spec.output_len)] * spec.requests
    rng = random.Random(spec.seed)
    r = spec.range_ratio

    def draw(n: int) -> int:
        return max(1, rng.randint(math.floor(n * (1 - r)), math.ceil(n * (1 + r))))

    return [(draw(spec.input_len), draw(spec.output_len)) for _ in range(spec.requests)]


def generate(spec: WorkloadSpec, *, name: str | None = None) -> Trace:
    """Simulate the chunked-prefill scheduler for a closed-loop benchmark (see module docstring)."""
    spec.validate()
    pending = deque(_Req(p, o) for p, o in _lengths(spec))
    waiting: deque[_Req] = deque()
    running: list[_Req] = []
    for _ in range(min(spec.concurrency, len(pending))):
        waiting.append(pending.popleft())

    steps: list[TraceStep] = []
    while running or waiting:
        budget = spec.max_num_batched_tokens
        scheduled: list[tuple[_Req, int]] = []
        for r in running:
            if budget <= 0:
                break
            want = r.prompt_len + r.generated - r.computed
            n = min(want, budget)
            if n > 0:
                scheduled.append((r, n))
                budget -= n
        while waiting and budget > 0 and len(running) < spec.max_num_seqs:
            r = waiting.popleft()
            n = min(r.prompt_len, budget)
            running.append(r)
            scheduled.append((r, n))
            budget -= n
        if not scheduled:  # cannot happen with budget >= 1; guards the loop's bound
            raise TraceError("scheduler made no progress")

        # decode rows first (query_len 1 after the prompt), then prefill chunks, stable order
        decode = [(r, n) for r, n in scheduled if r.computed >= r.prompt_len]
        prefill = [(r, n) for r, n in scheduled if r.computed < r.prompt_len]
        rows = decode + prefill
        q = np.fromiter((n for _, n in rows), dtype=np.int64, count=len(rows))
        s = np.fromiter((r.computed + n for r, n in rows), dtype=np.int64, count=len(rows))
        steps.append(TraceStep(q, s))

        finished = []
        for r, n in scheduled:
            r.computed += n
            if r.computed >= r.prompt_len + r.generated:
                r.generated += 1
                if r.generated >= r.output_len:
                    finished.append(r)
        for r in finished:
            running.remove(r)
            if pending:
                waiting.append(pending.popleft())

    meta = {
        "source": "simulated",
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "concurrency": spec.concurrency,
        "num_requests": spec.requests,
        "max_num_batched_tokens": spec.max_num_batched_tokens,
        "block_size": spec.block_size,
        "range_ratio": spec.range_ratio,
        "seed": spec.seed,
    }
    label = name or f"in{spec.input_len}-out{spec.output_len}-c{spec.concurrency}"
    return Trace(label, tuple(steps), meta)


# ----------------------------------------------------------------------------- shape logs


def shape_log_line(
    step: int,
    query_lens: Sequence[int] | np.ndarray,
    seq_lens: Sequence[int] | np.ndarray,
    *,
    rank: int | None = None,
) -> str:
    """One line of the shape-log format (no trailing newline). Host ints only: call it with
    ``query_start_loc_cpu``'s diff and ``seq_lens_cpu``, never with device tensors."""
    q = query_lens.tolist() if hasattr(query_lens, "tolist") else list(query_lens)
    s = seq_lens.tolist() if hasattr(seq_lens, "tolist") else list(seq_lens)
    rec: dict[str, Any] = {"step": int(step), "query_lens": q, "seq_lens": s}
    if rank is not None:
        rec["rank"] = int(rank)
    return json.dumps(rec, separators=(",", ":"))


def _int_list(rec: dict[str, Any], key: str, where: str) -> np.ndarray:
    v = rec.get(key)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise TraceError(f"{where}: field '{key}' must be a list of integers")
    a = np.asarray(v, dtype=np.int64)
    if a.size and a.min() < 0:
        raise TraceError(f"{where}: field '{key}' has a negative value")
    return a


def parse_trace_lines(lines: Sequence[str], *, name: str, rank: int | None = None) -> Trace:
    """Parse shape-log lines (see the module docstring); errors name the line and field."""
    meta: dict[str, Any] = {"source": "shape-log"}
    steps: list[TraceStep] = []
    for lineno, raw in enumerate(lines, 1):
        text = raw.strip()
        if not text:
            continue
        where = f"{name}:{lineno}"
        try:
            rec = safe_read.parse_json(text, source=where, max_depth=8)
        except safe_read.SafeReadError as exc:
            raise TraceError(str(exc)) from None
        if not isinstance(rec, dict):
            raise TraceError(f"{where}: each line must be a JSON object")
        if "format" in rec:
            if rec["format"] != SHAPE_LOG_FORMAT:
                raise TraceError(f"{where}: field 'format' must be {SHAPE_LOG_FORMAT!r}")
            if rec.get("version", SHAPE_LOG_VERSION) != SHAPE_LOG_VERSION:
                raise TraceError(
                    f"{where}: field 'version': unsupported (this reader knows {SHAPE_LOG_VERSION})"
                )
            meta.update({k: v for k, v in rec.items() if k not in ("format", "version")})
            continue
        if rank is not None and rec.get("rank", rank) != rank:
            continue
        q = _int_list(rec, "query_lens", where)
        s = _int_list(rec, "seq_lens", where)
        if q.size != s.size:
            raise TraceError(
                f"{where}: fields 'query_lens' and 'seq_lens' differ in length ({q.size} != {s.size})"
            )
        if q.size and bool((s < q).any()):
            raise TraceError(f"{where}: field 'seq_lens': every seq_len must be >= its query_len")
        steps.append(TraceStep(q, s))
    if not steps:
        raise TraceError(f"{name}: no steps" + (f" for rank {rank}" if rank is not None else ""))
    return Trace(str(meta.pop("name", name)), tuple(steps), meta)


def load_trace(path: str | Path, *, rank: int | None = None) -> Trace:
    """A recorded shape log (JSONL), e.g. from ``FLYSERVE_SHAPE_LOG=/tmp/shapes.jsonl vllm serve ...``."""
    p = Path(path)
    try:  # flyserve.files.safe_read: no FIFO waited on, no /dev/zero read without end
        text = safe_read.read_text(p, MAX_TRACE_BYTES, source=p.name, follow_symlinks=True)
    except safe_read.SafeReadError as exc:
        raise TraceError(str(exc)) from None
    if text is None:
        raise TraceError(f"{p.name}: no such file")
    return parse_trace_lines(text.splitlines(), name=p.stem, rank=rank)


def trace_from(name_or_path: str, **workload_args: Any) -> Trace:
    """A named workload if ``name_or_path`` is one, else a shape-log file."""
    if name_or_path in SEED_WORKLOADS:
        return workload(name_or_path, **workload_args)
    return load_trace(name_or_path)
