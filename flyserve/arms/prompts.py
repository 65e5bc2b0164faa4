"""The prompts file of `flyserve arms compare`: JSONL, one request a line.

Each line is an object with either `prompt` (a string: the completions API) or `messages`
(a list of {role, content}: the chat API), and optionally `answer` (the answer key; a gsm8k
solution ending in "#### N" works as is), `id` and `stop` (a list of stop strings sent with the
request, e.g. ["Question:"] for few-shot gsm8k prompts). Every bad line is reported with its
line number at once, so a large file is fixed in one pass rather than one error per run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Report at most this many bad lines (a file of the wrong format would otherwise flood the terminal).
MAX_REPORTED_ERRORS = 20


class PromptFileError(ValueError):
    """The prompts file is unusable; `.errors` lists (line number, reason), line numbers from 1."""

    def __init__(self, path: Path, errors: list[tuple[int, str]]) -> None:
        self.path = path
        self.errors = errors
        shown = "\n".join(f"  line {ln}: {why}" for ln, why in errors[:MAX_REPORTED_ERRORS])
        more = len(errors) - MAX_REPORTED_ERRORS
        tail = f"\n  ... and {more} more" if more > 0 else ""
        super().__init__(f"{path}: {len(errors)} bad line(s)\n{shown}{tail}")


@dataclass(frozen=True)
class PromptItem:
    """One request of the comparison, identical for both arms and every run."""

    index: int  # position among the valid prompts, from 0: the `prompt` key of the results file
    line: int  # line number in the file, from 1
    id: str
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    answer: str | None = None
    stop: tuple[str, ...] = ()

    @property
    def api(self) -> str:
        return "completions" if self.prompt is not None else "chat"


def _parse_messages(value: Any) -> tuple[tuple[dict[str, str], ...] | None, str | None]:
    if not isinstance(value, list) or not value:
        return None, "`messages` must be a non-empty list of {role, content} objects"
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return None, f"`messages[{i}]` must be an object with `role` and `content`"
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            return None, f"`messages[{i}].role` must be a non-empty string"
        if not isinstance(content, str):
            return None, f"`messages[{i}].content` must be a string"
        out.append({"role": role, "content": content})
    return tuple(out), None


def _parse_line(obj: Any, index: int, line: int) -> tuple[PromptItem | None, str | None]:
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    has_p, has_m = "prompt" in obj, "messages" in obj
    if has_p == has_m:
        return None, "needs exactly one of `prompt` (completions API) or `messages` (chat API)"
    prompt = messages = None
    if has_p:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            return None, "`prompt` must be a non-empty string"
    else:
        messages, err = _parse_messages(obj["messages"])
        if err:
            return None, err
    answer = obj.get("answer")
    if answer is not None:
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            return None, "`answer` must be a string or a number"
        answer = str(answer)
    raw_id = obj.get("id", index)
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
        return None, "`id` must be a string or an integer"
    stop = obj.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        return None, "`stop` must be a string or a list of non-empty strings"
    item = PromptItem(
        index=index,
        line=line,
        id=str(raw_id),
        prompt=prompt,
        messages=messages,
        answer=answer,
        stop=tuple(stop),
    )
    return item, None


def parse_prompts(text: str, path: Path = Path("<prompts>")) -> tuple[PromptItem, ...]:
    """Parse the whole file; raise PromptFileError listing every bad line. Blank lines are skipped."""
    items: list[PromptItem] = []
    errors: list[tuple[int, str]] = []
    seen_ids: dict[str, int] = {}
    for ln, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            errors.append((ln, f"not valid JSON ({exc.msg} at column {exc.colno})"))
            continue
        item, err = _parse_line(obj, len(items), ln)
        if err:
            errors.append((ln, err))
            continue
        assert item is not None
        if item.id in seen_ids:
            errors.append((ln, f"duplicate id {item.id!r} (first on line {seen_ids[item.id]})"))
            continue
        seen_ids[item.id] = ln
        items.append(item)
    if not items and not errors:
        errors.append((0, "no prompts (the file is empty)"))
    if errors:
        raise PromptFileError(path, errors)
    return tuple(items)


def load_prompts(path: Path) -> tuple[PromptItem, ...]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(path, [(0, f"cannot read the file: {exc}")]) from None
    return parse_prompts(text, path)


def prompts_fingerprint(items: tuple[PromptItem, ...]) -> str:
    """sha256 of what is sent (not of answers or ids): a results file is only resumable for the same requests."""
    h = hashlib.sha256()
    for it in items:
        sent = {
            "prompt": it.prompt,
            "messages": list(it.messages) if it.messages else None,
            "stop": list(it.stop),
        }
        h.update(json.dumps(sent, sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()
