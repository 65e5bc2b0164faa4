"""The resumable raw results file: JSONL, a header line then one line per (arm, run, prompt).

Every response is appended and flushed as soon as it arrives, so an interrupted comparison
(Ctrl-C, a server that died, a lost machine) loses at most the requests in flight; a re-run
skips what is recorded. A crash can leave a truncated last line: it is reported and cut off
before appending (a later record glued to it would be lost too). Damage anywhere else is not a
crash artefact, so it is an error naming the line rather than silently dropped data.

The header records what makes responses comparable (model, request parameters, the prompts'
fingerprint). Resuming with a different value is refused naming the field: mixing two settings in
one file would produce figures that describe neither. Runs are not in the header: re-running with a
larger --runs extends the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flyserve.arms.align import Response

FORMAT_VERSION = 1
#: Header fields that must match to resume (the URLs may change: servers restart on other ports).
MUST_MATCH = ("format", "prompts_sha256", "model_a", "model_b", "max_tokens", "top_logprobs", "seed")
_RECORD_FIELDS = ("arm", "run", "prompt", "text", "tokens", "top_logprobs")


def default_results_path(prompts: Path, env: dict[str, str] | None = None) -> Path:
    """Where the results go without --results: under $XDG_STATE_HOME/flyserve/arms (default
    ~/.local/state), named after the prompts file and a hash of its absolute path, so the same
    command resumes the same file. Not beside the prompts: those may sit in a checkout (the
    repository's examples/), which a comparison must not write into."""
    import hashlib
    import os

    env = dict(os.environ) if env is None else env
    base = Path(env.get("XDG_STATE_HOME") or Path(env.get("HOME") or Path.home()) / ".local" / "state")
    tag = hashlib.sha256(str(prompts.resolve()).encode()).hexdigest()[:12]
    return base / "flyserve" / "arms" / f"{prompts.stem}-{tag}.arms-results.jsonl"


def recorded_responses(path: Path) -> int | None:
    """Responses recorded in a results file (header and a truncated line not counted); None when
    there is no file, so a message never points at a file that does not exist."""
    try:
        with path.open("rb") as fh:
            lines = sum(1 for line in fh if line.endswith(b"\n"))
    except FileNotFoundError:
        return None
    return max(0, lines - 1)


class ResultsFileError(ValueError):
    """The results file cannot be used for this comparison; the message names the line or field."""


@dataclass
class ResultsFile:
    path: Path
    header: dict[str, Any]
    records: dict[tuple[str, int, int], Response] = field(default_factory=dict)  # compact, see Response
    notes: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, path: Path, header: dict[str, Any]) -> ResultsFile:
        """Load what is there (or start the file); check the header; cut a truncated last line."""
        header = {"kind": "header", "format": FORMAT_VERSION, **header}
        rf = cls(path=path, header=header)
        if not path.exists() or path.stat().st_size == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", encoding="utf-8") as fh:
                fh.write(json.dumps(header, ensure_ascii=False) + "\n")
            return rf
        raw = path.read_bytes()
        parts = raw.split(b"\n")
        if parts and parts[-1] == b"":
            parts.pop()  # the file ends with a newline
        offset = 0  # start of the current line
        cut_at: int | None = None
        for i, line in enumerate(parts, start=1):
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError("not a JSON object")  # noqa: TRY004 (caught below)
                if i == 1:
                    rf._check_header(obj)
                else:
                    rf._add(obj)
            except ResultsFileError:
                raise
            except ValueError as exc:
                if i == len(parts) and i > 1:
                    rf.notes.append(
                        f"{path}: line {i} is truncated or corrupt ({exc}); ignored and cut off "
                        "(its request is sent again)"
                    )
                    cut_at = offset
                    break
                raise ResultsFileError(f"{path}: line {i} is not a valid record ({exc})") from None
            offset += len(line) + 1
        if cut_at is not None:
            with path.open("r+b") as fh:
                fh.truncate(cut_at)
        elif not raw.endswith(b"\n"):  # a complete last line without its newline
            with path.open("ab") as fh:
                fh.write(b"\n")
        return rf

    def _check_header(self, obj: dict[str, Any]) -> None:
        if obj.get("kind") != "header":
            raise ResultsFileError(f"{self.path}: line 1 is not a flyserve arms results header")
        for key in MUST_MATCH:
            if obj.get(key) != self.header.get(key):
                raise ResultsFileError(
                    f"{self.path}: recorded {key}={obj.get(key)!r} but this comparison has "
                    f"{key}={self.header.get(key)!r}; use another --results file"
                )
        for key in ("a", "b"):
            if obj.get(key) != self.header.get(key):
                self.notes.append(
                    f"{self.path}: arm {key.upper()} was {obj.get(key)} when recorded, now {self.header.get(key)}"
                )

    def _add(self, obj: dict[str, Any]) -> None:
        missing = [f for f in _RECORD_FIELDS if f not in obj]
        if obj.get("kind") != "response" or missing:
            raise ValueError(f"missing {', '.join(missing) or 'kind=response'}")
        if (
            obj["arm"] not in ("a", "b")
            or not isinstance(obj["run"], int)
            or not isinstance(obj["prompt"], int)
        ):
            raise ValueError("arm must be 'a' or 'b', run and prompt integers")
        self.records[(obj["arm"], obj["run"], obj["prompt"])] = Response.from_record(obj)

    def has(self, arm: str, run: int, prompt: int) -> bool:
        return (arm, run, prompt) in self.records

    def append(self, record: dict[str, Any]) -> None:
        rec = {"kind": "response", **record}
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
            fh.flush()
        self.records[(rec["arm"], rec["run"], rec["prompt"])] = Response.from_record(rec)
