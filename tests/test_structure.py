"""The architecture reads off the tree: no import cycle inside workbench/ (imports inside
functions count too: a lazy import hides a cycle, it does not remove it), no module over 400
lines and no function over 80."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from conftest import REPO

PKG = REPO / "workbench"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 80


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The workbench modules `name` imports, wherever in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    mods = _modules()
    graph = {name: _imports(name, path, set(mods)) for name, path in mods.items()}
    # A package's __init__ importing its own submodule is not a cycle of design.
    for name in graph:
        graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    assert _cycles(graph) == []


def test_module_and_function_sizes():
    big_modules, big_functions = [], []
    for name, path in _modules().items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            big_modules.append(f"{name}: {len(text.splitlines())}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    big_functions.append(f"{name}.{node.name}: {length}")
    assert big_modules == [] and big_functions == []


def test_no_merge_conflict_markers_in_tracked_files():
    """A conflict left in a README block once hid four benchmark commands from the README test."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    marker = re.compile(r"^(<{7}|>{7})( |$)|^={7}$", re.M)
    hits = [f for f in files if (REPO / f).is_file() and (REPO / f).stat().st_size < 2_000_000
            and marker.search((REPO / f).read_text(errors="ignore"))]
    assert not hits, f"merge conflict markers in {hits}"


def _is_command(path: Path) -> bool:
    """A module run as `python -m ...`: a package's __main__ or one with a __main__ guard."""
    text = path.read_text()
    return path.name == "__main__.py" or 'if __name__ == "__main__":' in text


def test_only_commands_import_the_command_line_module():
    """The error classes live in workbench.errors, below everything: a library module reports
    bad input without depending on the command line."""
    mods = _modules()
    users = sorted(name for name, path in mods.items()
                   if "workbench.cli" in _imports(name, path, set(mods))
                   and not _is_command(path))
    assert users == [], users


def test_the_layout_value_sits_below_the_planner():
    """workbench.layout is imported by every rank and by the planner: it imports nothing from
    workbench.plan (validating a layout against the rules is the planner's job)."""
    mods = _modules()
    assert not {m for m in _imports("workbench.layout", mods["workbench.layout"], set(mods))
                if m.startswith("workbench.plan")}


def test_the_planner_lives_in_rooms():
    """workbench/plan/ holds its command entries and a few modules directly; the library lives
    in its rooms (cost/, search/, pools/, accuracy/), one concept each."""
    direct = sorted(p.name for p in (PKG / "plan").glob("*.py"))
    assert len(direct) <= 12, direct


def test_lowrank_and_train_meet_only_at_the_hook_interface():
    """Low-rank training plugs into the trainer through its hooks: workbench.lowrank imports
    nothing of workbench.train but the hook module, and no module of workbench.train reaches
    workbench.lowrank, even through others (the hooks are chosen above both, in
    workbench/rank.py, which `python -m workbench.train`, the one command there, runs)."""
    mods = _modules()
    graph = {name: _imports(name, path, set(mods)) for name, path in mods.items()}
    in_lowrank = [n for n in graph if n.startswith("workbench.lowrank")]
    up = {n: sorted(t for t in graph[n] if t.startswith("workbench.train")
                    and t not in ("workbench.train", "workbench.train.hooks"))
          for n in in_lowrank}
    assert in_lowrank and {n: t for n, t in up.items() if t} == {}

    def reach(name: str) -> set[str]:
        seen, todo = set(), [name]
        while todo:
            for t in graph[todo.pop()] - seen:
                seen.add(t)
                todo.append(t)
        return seen

    in_train = [n for n in graph if n.startswith("workbench.train")
                and n != "workbench.train.__main__"]
    down = {n: sorted(t for t in reach(n) if t.startswith("workbench.lowrank"))
            for n in in_train}
    assert in_train and {n: t for n, t in down.items() if t} == {}
