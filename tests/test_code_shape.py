"""The package's shape budgets as facts (../shared/STYLE.md, docs/architecture.md "Which way imports run").

- every module at most 500 lines, but for a short allowlist with the reason for each;
- every function at most 60 lines;
- no import cycle among package modules, counting imports inside functions and under
  `TYPE_CHECKING` (a lazy import hides a cycle from Python, not from a reader); the monitor
  back-ends are the one allowed cycle: `monitor.py` loads the plug-in each config names, and each
  plug-in subclasses its base;
- `comm/` imports nothing from `launcher/` (the launcher reads what ranks write, never the other way).

Read from the source with `ast`, no imports of the package, so a failure names the file and line.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zerospeed"

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
LONG_FILES = {
    # copied into every checkpoint and run there with torch, the stdlib and safetensors alone
    "zerospeed/utils/zero_to_fp32.py": "standalone: it cannot import the helpers it would be split into",
}
ALLOWED_CYCLES = [
    {"zerospeed.monitor.monitor", "zerospeed.monitor.tensorboard", "zerospeed.monitor.csv_monitor",
     "zerospeed.monitor.wandb", "zerospeed.monitor.comet"},
]


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """Package modules `module` imports anywhere in its body (a package import counts as its __init__)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("zerospeed"):
                target = _resolve(name, modules)
                if target is not None and target != module:
                    targets.add(target)
    return targets


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_files_stay_within_the_line_budget():
    over = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    over = {name: lines for name, lines in over.items() if lines > MAX_FILE_LINES and name not in LONG_FILES}
    assert not over, f"files over {MAX_FILE_LINES} lines (split them, or allowlist with a reason): {over}"
    assert all((ROOT / name).exists() for name in LONG_FILES), "an allowlisted file no longer exists"


def test_functions_stay_within_the_line_budget():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_import_cycles():
    modules = _modules()
    graph = {module: _imported(module, path, modules) for module, path in modules.items()}
    cycles = [sorted(c) for c in _cycles(graph) if c not in ALLOWED_CYCLES]
    assert not cycles, f"import cycles (lazy and TYPE_CHECKING imports count): {cycles}"


def test_comm_does_not_import_the_launcher():
    modules = _modules()
    offenders = {module: sorted(t for t in _imported(module, path, modules) if t.startswith("zerospeed.launcher"))
                 for module, path in modules.items() if module.startswith("zerospeed.comm")}
    assert not any(offenders.values()), offenders


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b"}, "b": set()}) == []
