"""The package layout of docs/architecture.md, checked over the code's own imports.

Every ``import`` and ``from ... import`` of every module of flyserve is read with ast (lazy imports
inside functions included: they run in the same process sooner or later), so the rules hold for
what the code does, not for what a reader remembers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # 11 s on the 2-core VM: each test parses every module of flyserve

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "flyserve"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(source: str, *, top_level_only: bool) -> set[str]:
    """flyserve modules named by the imports of ``source`` (``from a import b``: a, and a.b if a module)."""
    tree = ast.parse(source)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    named: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            named |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named.add(node.module)
            named |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in named if m in MODULES}


def _graph(*, top_level_only: bool) -> dict[str, set[str]]:
    return {m: _imports(p.read_text(), top_level_only=top_level_only) - {m} for m, p in MODULES.items()}


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for start, first_children in graph.items():
        if start in index:
            continue
        work = [(start, iter(sorted(first_children)))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _reachable(graph: dict[str, set[str]], starts: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    return seen


def _in(package: str) -> list[str]:
    return [m for m in MODULES if m == package or m.startswith(package + ".")]


SANITISER = "flyserve.terminal.printable"
"""The one sanitiser of text bound for a terminal: every command prints through it, so every package
with a command may import it, policy and arms included; it imports nothing of flyserve (checked
below), so importing it reaches nothing else."""


FILES = "flyserve.files"
"""The shared room for hardened file access (safe reads, the atomic write, the pid check): below
every other package, so any of them may use it, and it imports nothing of flyserve."""


def _base() -> set[str]:
    """What every package may import: the terminal sanitiser and the files room."""
    return {SANITISER, *_in(FILES)}


def test_the_graph_sees_lazy_imports_and_circles():
    """The checks below would pass on an empty graph: show that it finds a lazy import and a circle."""
    lazy = "def f():\n    from flyserve.lab.workloads import workload\n"
    assert _imports(lazy, top_level_only=False) == {"flyserve.lab.workloads"}
    assert _imports(lazy, top_level_only=True) == set()
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert len(MODULES) > 40


def test_no_import_circle_at_module_level():
    assert _circles(_graph(top_level_only=True)) == []


def test_no_import_circle_counting_lazy_imports():
    assert _circles(_graph(top_level_only=False)) == []


def test_the_sidecar_reaches_nothing_of_lab_arms_sim_or_vllm():
    """The sidecar runs beside vLLM in its own small process: not the lab's tools, not vllm."""
    reached = _reachable(_graph(top_level_only=False), _in("flyserve.sidecar"))
    leaked = sorted(
        m for m in reached if m.split(".")[1] in {"lab", "arms", "sim", "vllm", "demo", "dashboards"}
    )
    assert leaked == []


def test_the_terminal_sanitiser_imports_nothing_of_flyserve():
    """Lazy imports and relative ones included: a relative import would escape ``_imports``."""
    assert SANITISER in MODULES
    assert _graph(top_level_only=False)[SANITISER] == set()
    tree = ast.parse(MODULES[SANITISER].read_text())
    assert [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0] == []


def test_arms_and_lab_are_separate_products():
    graph = _graph(top_level_only=False)
    assert not [m for m in _in("flyserve.lab") if Path(MODULES[m]).name.startswith("arms")]
    arms_reach = _reachable(graph, _in("flyserve.arms")) - _base()
    assert sorted(m for m in arms_reach if m.startswith("flyserve.") and m.split(".")[1] != "arms") == []
    lab_reach = _reachable(graph, _in("flyserve.lab"))
    assert sorted(m for m in lab_reach if m.startswith("flyserve.arms")) == []


def test_policy_imports_nothing_above_it():
    """Nothing of flyserve but the sanitiser, not even the files room: policy reads no file
    (flyserve.thresholds_files reads profiles and hands policy the bytes)."""
    reached = _reachable(_graph(top_level_only=False), _in("flyserve.policy")) - {SANITISER}
    assert sorted(m for m in reached if m != "flyserve" and m.split(".")[1] != "policy") == []


FILE_MODULES = frozenset({"os", "pathlib", "io", "shutil", "glob", "tempfile", "mmap", "fcntl", "fileinput"})
"""Modules made for reaching the file system: policy imports none of them."""

FILE_CALLS = frozenset(
    {
        "open",
        "read_text",
        "read_bytes",
        "write_text",
        "write_bytes",
        "stat",
        "lstat",
        "exists",
        "is_file",
        "is_dir",
        "iterdir",
        "glob",
        "rglob",
        "scandir",
        "listdir",
        "fromfile",
        "tofile",
        "loadtxt",
        "genfromtxt",
        "memmap",
    }
)
"""Calls named like a file operation: open(), Path.read_text, os.stat, np.fromfile, ..."""


def _file_io(source: str) -> list[str]:
    """Where ``source`` reaches the file system: an import of one of FILE_MODULES, or a call (a bare
    name or an attribute, lazy ones included) named in FILE_CALLS; by line."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found += [(node.lineno, f"import {n}") for n in names if n.split(".")[0] in FILE_MODULES]
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in FILE_CALLS:
                found.append((node.lineno, f"{ast.unparse(f)}()"))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_the_file_io_check_sees_reads_and_passes_parsing():
    """The check below would pass on a check that finds nothing: show it finds each kind."""
    planted = (
        "import os\n"
        "from pathlib import Path\n"
        "def f(p):\n"
        "    open(p)\n"
        "    Path(p).read_text()\n"
        "    os.stat(p)\n"
        "    import numpy as np; np.fromfile(p)\n"
    )
    assert _file_io(planted) == [
        "1: import os",
        "2: import pathlib",
        "4: open()",
        "5: Path(p).read_text()",
        "6: os.stat()",
        "7: np.fromfile()",
    ]
    assert _file_io("import yaml\ndef f(raw: bytes):\n    return yaml.safe_load(raw.decode())\n") == []


def test_policy_reads_no_file():
    """A decision is a pure function of (shape, thresholds), run per engine step: no module of
    policy opens, stats or lists a file (finding and reading profiles is flyserve.thresholds_files')."""
    offenders = [f"{m}:{hit}" for m in _in("flyserve.policy") for hit in _file_io(MODULES[m].read_text())]
    assert offenders == []


def test_only_the_vllm_package_and_the_lab_import_vllm_or_torch():
    """Core install stays light: vllm and torch are imported lazily, by flyserve.vllm, the lab, the demo,
    the doctor (it checks them) and the CUDA-event kernel timer only."""
    allowed = (
        "flyserve.vllm",
        "flyserve.lab",
        "flyserve.demo",
        "flyserve.doctor",
        "flyserve.telemetry.gpu_timer",
    )
    offenders = []
    for m, p in MODULES.items():
        if m.startswith(allowed):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n.split(".")[0] in {"vllm", "torch"} for n in names):
                offenders.append(f"{m}:{node.lineno}")
    assert offenders == []


def test_the_package_root_holds_only_the_package_and_the_command_table():
    """Every command and every shared room is a package of its own; a loose module at the root is a
    room nobody drew on the map (docs/architecture.md)."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in {"__init__.py", "cli.py"})
    assert loose == []
    assert all(
        (d / "__init__.py").is_file() for d in PACKAGE.iterdir() if d.is_dir() and d.name != "__pycache__"
    )


def test_the_files_room_imports_nothing_of_flyserve():
    graph = _graph(top_level_only=False)
    assert _in(FILES) and {m: graph[m] for m in _in(FILES) if graph[m]} == {}


def test_one_atomic_write_and_one_pid_check():
    """Writes a reader may see mid-write go through flyserve.files.atomic; a pid is asked about
    through flyserve.files.processes: no second copy of either grows back elsewhere."""
    offenders = []
    for m, p in MODULES.items():
        if m.startswith(FILES + "."):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            f = node.func
            is_os_kill = f.attr == "kill" and isinstance(f.value, ast.Name) and f.value.id == "os"
            if is_os_kill and len(node.args) == 2 and ast.unparse(node.args[1]) == "0":
                offenders.append(f"{m}:{node.lineno}: os.kill(pid, 0)")
            if f.attr in ("replace", "rename") and node.args and m not in JOURNALED_RENAMES:
                # os.replace(tmp, path) names the temp file first; Path.replace(path) is called on it
                src = ast.unparse(node.args[0] if len(node.args) == 2 else f.value)
                if "tmp" in src.lower() or "temp" in src.lower():
                    offenders.append(f"{m}:{node.lineno}: {f.attr}({src}, ...)")
    assert offenders == []


JOURNALED_RENAMES = {"flyserve.telemetry.compaction"}
"""Not an atomic write: compaction merges into a temp archive that a journal names, and renames it
only at the journal's commit point (a crash between the two is finished by the next run), so its
temp file must outlive the write (the protocol: flyserve/telemetry/compaction.py's docstring)."""


def test_one_state_dir_option():
    """Every command's --state-dir is flyserve.control.options.StateDirArg: one help, one variable.
    The simulator's rank workers (sim/rank.py, argparse) are started by `flyserve simulate`
    itself with an explicit path; they are not a command an operator types."""
    defined = []
    for m, p in MODULES.items():
        for node in ast.walk(ast.parse(p.read_text())):
            is_option = isinstance(node, ast.Call) and ast.unparse(node.func).endswith(".Option")
            if is_option and any(isinstance(a, ast.Constant) and a.value == "--state-dir" for a in node.args):
                defined.append(m)
    assert defined == ["flyserve.control.options"]
