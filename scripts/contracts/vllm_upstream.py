"""What a new vLLM changes for flyserve: its touch points against the newest recorded release.

Given a vLLM release that is not recorded yet (its wheel, its sdist or an unpacked tree), this reads
its touch points the way scripts/contracts/vllm_touchpoints.py records them and says what differs
from the newest record in tests/data/contracts/vllm_touchpoints/, then what that means for flyserve:

  touch points   each one that changed, as the docs table words it (+added, -gone, before -> after)
  imports        every vllm name flyserve imports that the release lacks and the recorded one had
                 (file:line; "has a fallback" when the import is guarded), and the seed backend's
  flyserve       follow-ups: AttentionImpl methods flyserve's composite does not account for
                 (flyserve/vllm/backends.py IMPL_METHODS), members a release drops that flyserve's
                 source names (file:line), new AttentionBackend members (vLLM's composite inherits the
                 base's answer unless flyserve gives one), the keywords vLLM's own AITER call passes
                 that a recorded aiter signature (tests/data/contracts/aiter_unified_attention-*.json)
                 lacks, and the torch the wheel pins (an import of the release needs it)

Nothing is imported from the release and nothing is written. Exit status: 0 nothing changed for
flyserve, 1 something to review (the report says what), 2 the source could not be read.

Release checklist (docs/vllm.md, "Staying current"):

  1. python -m pip download --no-deps vllm==X.Y.Z -d /tmp/vllm-X.Y.Z        (never installed)
  2. python scripts/contracts/vllm_upstream.py /tmp/vllm-X.Y.Z/vllm-X.Y.Z-*.whl
     handle each finding in flyserve (code, IMPL_METHODS, docs/vllm.md's list of changes)
  3. python scripts/contracts/vllm_touchpoints.py /tmp/vllm-X.Y.Z/vllm-X.Y.Z-*.whl --uploaded DATE \\
         > tests/data/contracts/vllm_touchpoints/X.Y.Z.json
     and a RecordedRelease (version, the record's digest, a note) in flyserve/doctor/vllm_versions.py
  4. python scripts/contracts/vllm_touchpoints.py --table tests/data/contracts/vllm_touchpoints
     pasted over docs/vllm.md's table
  5. pytest tests/unit/test_vllm_touchpoints.py tests/unit/test_vllm_upstream_report.py
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
import re
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_touchpoints as tp  # the extractor beside this script

REPO = Path(__file__).resolve().parents[2]
CONTRACTS = Path("tests/data/contracts")
AITER_CONTRACTS = "aiter_unified_attention-*.json"


@dataclass
class Review:
    """What one release changes for flyserve, against one recorded release."""

    release: str
    against: str
    touchpoints: dict[str, list[str]] = field(default_factory=dict)
    imports: list[str] = field(default_factory=list)
    seed_imports: list[str] = field(default_factory=list)
    unaccounted_impl_methods: list[str] = field(default_factory=list)
    dropped_names_flyserve_uses: list[str] = field(default_factory=list)
    new_backend_members: list[str] = field(default_factory=list)
    aiter_call: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Facts that are no finding by themselves (the torch the wheel pins, the AITER call's keywords)."""

    def findings(self) -> int:
        return (
            len(self.touchpoints) + len(self.imports) + len(self.seed_imports)
            + len(self.unaccounted_impl_methods) + len(self.dropped_names_flyserve_uses)
            + len(self.new_backend_members) + len(self.aiter_call)
        )  # fmt: skip


# ----------------------------------------------------------------------------- reading the release


def release_name(source: Path) -> str:
    """The release a wheel's or sdist's name says, else the version in a tree's dist-info or
    ``vllm/_version.py``, else "unknown"."""
    found = tp.release_of(source)
    if found:
        return found
    if source.is_dir():
        for meta in sorted(source.glob("vllm-*.dist-info/METADATA")):
            m = re.search(r"^Version: (\S+)", meta.read_text(encoding="utf-8"), re.MULTILINE)
            if m:
                return m.group(1)
        version_py = source / "vllm" / "_version.py"
        if version_py.is_file():
            m = re.search(
                r"""__version__\s*=\s*version\s*=\s*['"]([^'"]+)""", version_py.read_text(encoding="utf-8")
            )
            if m:
                return m.group(1)
    return "unknown"


def torch_pin(source: Path) -> str | None:
    """The ``Requires-Dist: torch...`` line of a wheel's (or an unpacked tree's) metadata."""
    text = ""
    if source.is_file() and zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as whl:
            names = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
            text = whl.read(names[0]).decode("utf-8") if names else ""
    elif source.is_dir():
        metas = sorted(source.glob("vllm-*.dist-info/METADATA"))
        text = metas[0].read_text(encoding="utf-8") if metas else ""
    m = re.search(r"^Requires-Dist: (torch\b[^;\n]*)", text, re.MULTILINE)
    return m.group(1).strip() if m else None


def read(source: Path, repo: Path = REPO) -> tuple[dict[str, Any], tp.Tree]:
    """The release's record body (touch points and import tables, as the extractor makes them)."""
    tree = tp.Tree.open(source)
    return tp.extract(tree, _all_imports(repo)), tree


@functools.cache
def _all_imports(repo: Path) -> tuple[tuple[str, str | None], ...]:
    """flyserve's vllm imports, read once per run (two releases are read against one source tree)."""
    return tuple(tp.all_imports(repo))


@functools.cache
def _import_sites(repo: Path) -> dict[str, Any]:
    return {s.key: s for s in tp.flyserve_imports(repo)}


@functools.cache
def _flyserve_sources(repo: Path) -> tuple[tuple[str, ast.Module], ...]:
    return tuple(
        (path.relative_to(repo).as_posix(), ast.parse(path.read_text(encoding="utf-8")))
        for path in sorted((repo / "flyserve").rglob("*.py"))
    )


def against_record(against: str | None, records: Path, repo: Path = REPO) -> tuple[str, dict[str, Any]]:
    """(its name, the record to compare with): the newest record by default; a recorded version; a
    record JSON file; or another release's source (a wheel, an sdist, a directory)."""
    recorded = tp.load_records(records)
    if not against:
        newest = max(recorded, key=lambda v: tuple(int(x) for x in v.split(".")))
        return newest, recorded[newest]
    if against in recorded:
        return against, recorded[against]
    path = Path(against)
    if path.is_file() and path.suffix == ".json":
        return path.name, json.loads(path.read_text(encoding="utf-8"))
    if path.exists():
        return f"{release_name(path)} ({path.name})", read(path, repo)[0]
    raise SystemExit(
        f"--against {against}: neither a recorded release ({', '.join(sorted(recorded))}) nor a path"
    )


# ----------------------------------------------------------------------------- what changed for flyserve


def _members(entry: Any) -> dict[str, Any]:
    return entry.get("members", {}) if isinstance(entry, dict) and "missing" not in entry else {}


def dropped_members(base: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str]]:
    """(touch point, member) for every member a touch point had in ``base`` and lacks in ``new``
    (the child backends' members included)."""
    out = []
    for name, entry in base["touchpoints"].items():
        other = new["touchpoints"].get(name, {})
        out += [(name, m) for m in _members(entry) if m not in _members(other)]
    children_new = new["touchpoints"].get("child backends", {})
    for cls, members in base["touchpoints"].get("child backends", {}).items():
        for m, entry in members.items():
            now = children_new.get(cls, {}).get(m, {"missing": True})
            if "missing" not in entry and "missing" in now:
                out.append((cls.rsplit(".", 1)[-1], m))
    return out


def flyserve_name_uses(repo: Path, names: Iterable[str]) -> dict[str, list[str]]:
    """Where flyserve's source names each of ``names``: attributes, names, definitions and string
    constants (getattr by string counts), as file:line."""
    watch = set(names)
    out: dict[str, list[tuple[str, int]]] = {}
    for rel, module in _flyserve_sources(repo):
        for node in ast.walk(module):
            hit = None
            if isinstance(node, ast.Attribute):
                hit = node.attr
            elif isinstance(node, ast.Name):
                hit = node.id
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                hit = node.name
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                hit = node.value
            if hit in watch:
                out.setdefault(hit, []).append((rel, node.lineno))
    return {name: [f"{f}:{n}" for f, n in sorted(set(hits))] for name, hits in out.items()}


def signature_of(contract: dict[str, Any]) -> inspect.Signature:
    """A recorded signature (extract_signature.py's format) as an inspect.Signature."""
    params = []
    for p in contract["parameters"]:
        kind = getattr(inspect.Parameter, p["kind"])
        default = inspect.Parameter.empty if p.get("required", True) else p.get("default")
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            default = inspect.Parameter.empty
        params.append(inspect.Parameter(p["name"], kind, default=default))
    return inspect.Signature(params)


def aiter_call_findings(tree: tp.Tree, contracts: list[Path]) -> tuple[list[str], list[str]]:
    """(findings, notes) of vLLM's own AITER unified-attention call against each recorded aiter."""
    from flyserve.doctor.aiter_calls import AITER_BACKEND, aiter_calls, unbound

    text = tree.text(AITER_BACKEND)
    if text is None:
        return [f"{AITER_BACKEND} is gone: the ROCm pair's general kernel moved"], []
    calls = aiter_calls(text)
    if not calls:
        return [
            f"{AITER_BACKEND}: no call of aiter's unified_attention found (vLLM calls AITER differently)"
        ], []
    notes = [f"vLLM's AITER call, {AITER_BACKEND}:{c.line}: {', '.join(c.keywords)}" for c in calls]
    findings = []
    for path in contracts:
        contract = json.loads(path.read_text(encoding="utf-8"))
        sig = signature_of(contract)

        def fn(*a: Any, _sig: inspect.Signature = sig, **k: Any) -> None:
            _sig.bind(*a, **k)

        fn.__signature__ = sig  # type: ignore[attr-defined]
        commit = contract.get("source", {}).get("commit", "")[:8]
        for call in calls:
            missing, error = unbound(call, fn)
            if missing or error:
                what = f"passes {', '.join(m + '=' for m in missing)}" if missing else error
                findings.append(
                    f"{AITER_BACKEND}:{call.line} {what}, which aiter {commit} ({path.name}) does not take: "
                    "an aiter that old fails inside vLLM on the first forward (record a newer aiter, "
                    "docs/vllm.md 'Which aiter')"
                )
    return findings, notes


def review(
    new: dict[str, Any],
    base: dict[str, Any],
    *,
    release: str,
    against: str,
    tree: tp.Tree | None = None,
    repo: Path = REPO,
    torch: str | None = None,
) -> Review:
    """What ``new`` changes for flyserve against ``base`` (record bodies)."""
    out = Review(release, against)
    for name, entry in base["touchpoints"].items():
        kind, diff = tp.status(entry, new["touchpoints"].get(name, {"missing": name}))
        if kind != "ok":
            out.touchpoints[name] = [f"{kind}: {d}" for d in diff] or [kind]
    for name in new["touchpoints"].keys() - base["touchpoints"].keys():
        out.touchpoints[name] = ["new touch point"]
    sites = _import_sites(repo)
    for key, entry in sorted(new["imports"].items()):
        if "missing" in entry and "missing" not in base["imports"].get(key, {}):  # newly missing
            s = sites.get(key)
            where = f" ({s.file}:{s.line}{', has a fallback' if s.guarded else ''})" if s else ""
            out.imports.append(f"{key}: {entry['missing']}{where}")
    for key, entry in new["seed imports"].items():
        kind, diff = tp.status(base["seed imports"].get(key, {"missing": "not recorded"}), entry)
        if kind != "ok":
            out.seed_imports.append(f"{key}: {kind} ({'; '.join(diff)})")

    from flyserve.vllm.backends import IMPL_METHODS

    impl = {
        **_members(new["touchpoints"].get("AttentionImplBase")),
        **_members(new["touchpoints"].get("AttentionImpl")),
    }
    out.unaccounted_impl_methods = sorted(
        m for m, e in impl.items() if "params" in e and m not in IMPL_METHODS
    )
    dropped = dropped_members(base, new)
    uses = flyserve_name_uses(repo, {m for _, m in dropped if not m.startswith("__")})
    for touch, member in dropped:
        if member in uses:
            out.dropped_names_flyserve_uses.append(
                f"{touch}.{member}: gone; flyserve names it at {', '.join(uses[member][:6])}"
            )
    backend_new = _members(new["touchpoints"].get("AttentionBackend"))
    backend_base = _members(base["touchpoints"].get("AttentionBackend"))
    composite = _members(new["touchpoints"].get("composite backend"))
    answered = flyserve_name_uses(repo, backend_new.keys() - backend_base.keys())
    for member in sorted(backend_new.keys() - backend_base.keys()):
        how = (
            "vLLM's composite forwards it"
            if member in composite
            else "vLLM's composite inherits the base's answer"
        )
        ours = (
            f"; flyserve names it at {', '.join(answered[member][:4])}"
            if member in answered
            else "; flyserve does not answer it"
        )
        out.new_backend_members.append(
            f"AttentionBackend.{member}{tp._show(backend_new[member])}: {how}{ours}"
        )
    if tree is not None:
        contracts = sorted((repo / CONTRACTS).glob(AITER_CONTRACTS))
        out.aiter_call, notes = aiter_call_findings(tree, contracts)
        out.notes += notes
    if torch:
        out.notes.append(f"the wheel requires {torch}: importing this vLLM needs that torch")
    return out


# ----------------------------------------------------------------------------- the report


SECTIONS = (
    ("touchpoints", "touch points that changed"),
    ("imports", "vllm names flyserve imports that this release lacks (the recorded one has them)"),
    ("seed_imports", "names the seed backend imports (vLLM PR 53335), changed"),
    ("unaccounted_impl_methods", "AttentionImpl methods flyserve's composite does not account for (backends.IMPL_METHODS)"),
    ("dropped_names_flyserve_uses", "members this release drops that flyserve's source names"),
    ("new_backend_members", "new AttentionBackend members: decide what flyserve's composites answer"),
    ("aiter_call", "vLLM's own AITER call against the recorded aiter signatures"),
)  # fmt: skip


def render(r: Review) -> str:
    lines = [f"vLLM {r.release} against the recorded {r.against}: {r.findings()} finding(s) for flyserve", ""]
    for key, title in SECTIONS:
        value = getattr(r, key)
        if not value:
            continue
        lines.append(f"{title}:")
        if isinstance(value, dict):
            for name, diffs in value.items():
                lines.append(f"  {name}")
                lines += [f"    {d}" for d in diffs]
        else:
            lines += [f"  {v}" for v in value]
        lines.append("")
    if r.notes:
        lines.append("notes:")
        lines += [f"  {n}" for n in r.notes]
        lines.append("")
    if r.findings():
        lines.append("next: handle each finding, then record the release (steps 3-5 of --help)")
    else:
        lines.append("nothing changed for flyserve: record the release (steps 3-5 of --help)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        prog="vllm_upstream.py",
        description=doc.split("\n\n", 1)[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", type=Path, help="the new vLLM: a vllm-X.Y.Z-*.whl wheel, a vllm-X.Y.Z.tar.gz sdist, "
                   "or a directory holding vllm/ (an unpacked wheel)")  # fmt: skip
    p.add_argument("--against", help="compare with this instead of the newest record: a recorded version, a "
                   "record JSON, or another release's wheel/sdist/directory")  # fmt: skip
    p.add_argument("--records", type=Path, default=REPO / tp.RECORDS, help="the directory of records")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = p.parse_args(argv)
    try:
        new, tree = read(args.source)
    except (OSError, SystemExit, SyntaxError, zipfile.BadZipFile) as exc:
        print(f"vllm_upstream: {args.source}: cannot read it ({exc})", file=sys.stderr)
        return 2
    against, base = against_record(args.against, args.records)
    r = review(
        new, base, release=release_name(args.source), against=against, tree=tree, torch=torch_pin(args.source)
    )
    print(json.dumps(asdict(r), indent=1) if args.json else render(r), end="" if not args.json else "\n")
    return 1 if r.findings() else 0


if __name__ == "__main__":
    raise SystemExit(main())
