"""Write a function's signature, read from its source text with ``ast``, as a JSON description.

Run by a developer when a kernel library moves, never at test time (tests read the committed
JSON in tests/data/contracts/). The source is read from a git checkout, so the description
names the exact commit it came from:

    git -C FlyDSL show 943152de:kernels/attention/flash_attn_interface.py > /tmp/fi.py
    python scripts/contracts/extract_signature.py /tmp/fi.py flydsl_flash_attn_func \
        --repo ROCm/FlyDSL --ref refs/pull/1056/head --commit 943152de... --date 2026-08-22 \
        --path kernels/attention/flash_attn_interface.py > tests/data/contracts/flydsl_flash_attn_func-pr1056-943152de.json

Only parameter names, kinds and defaults (literal values) are kept: data, not the library's code.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

KINDS = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY", "VAR_KEYWORD")


def _default(node: ast.expr | None) -> dict:
    if node is None:
        return {"required": True}
    try:
        return {"required": False, "default": ast.literal_eval(node)}
    except ValueError:
        return {"required": False, "default_expr": ast.unparse(node)}


def describe(source: str, function: str) -> list[dict]:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            a = node.args
            out: list[dict] = []
            pos = a.posonlyargs + a.args
            pos_defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
            for i, (arg, d) in enumerate(zip(pos, pos_defaults, strict=True)):
                kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
                out.append({"name": arg.arg, "kind": kind, **_default(d)})
            if a.vararg:
                out.append({"name": a.vararg.arg, "kind": "VAR_POSITIONAL", "required": False})
            for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
                out.append({"name": arg.arg, "kind": "KEYWORD_ONLY", **_default(d)})
            if a.kwarg:
                out.append({"name": a.kwarg.arg, "kind": "VAR_KEYWORD", "required": False})
            return out
    raise SystemExit(f"no function {function!r} in the source")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path)
    p.add_argument("function")
    p.add_argument("--repo", required=True)
    p.add_argument("--ref", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--date", required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--module", help="import path of the module (default: path with dots)")
    args = p.parse_args(argv)
    params = describe(args.source.read_text(encoding="utf-8"), args.function)
    doc = {
        "format": "flyserve-signature",
        "version": 1,
        "function": args.function,
        "module": args.module or args.path.removesuffix(".py").replace("/", "."),
        "source": {
            "repo": args.repo,
            "ref": args.ref,
            "commit": args.commit,
            "date": args.date,
            "path": args.path,
        },
        "parameters": params,
    }
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
