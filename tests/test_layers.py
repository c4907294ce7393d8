"""The package's layering holds: the import-linter contracts in pyproject.toml, no import cycles (function-
level imports included), no private name imported across modules, and nothing imports the command line."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import paracheck

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = pathlib.Path(paracheck.__file__).resolve().parent


def _imports() -> dict[str, list[tuple[str, str, int]]]:
    """module -> [(imported module, name or "", line)] for every import in it, at any depth of the file."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    found: dict[str, list[tuple[str, str, int]]] = {}
    for m in sorted(modules):
        edges = []
        for node in ast.walk(ast.parse((PACKAGE / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level == 1 or base == "paracheck" or base.startswith("paracheck."):
                    base = base.removeprefix("paracheck").lstrip(".") if node.level == 0 else base
                    for alias in node.names:
                        target = base.split(".")[0] if base else alias.name
                        edges.append((target, alias.name if base else "", node.lineno))
            elif isinstance(node, ast.Import):
                edges += [(a.name.split(".")[1], "", node.lineno) for a in node.names
                          if a.name.startswith("paracheck.")]
        found[m] = [e for e in edges if e[0] in modules and e[0] != m]
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_function_level_imports_included():
    graph = {m: {target for target, _, _ in edges} for m, edges in _imports().items()}
    assert graph["explore"] >= {"library", "fitting"}  # probe's function-level imports are seen
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_is_imported_across_modules():
    private = [f"{m}:{line} imports {target}.{name}" for m, edges in _imports().items()
               for target, name, line in edges if name.startswith("_") and not name.startswith("__")]
    assert private == []


def test_nothing_but_the_entry_point_imports_the_command_line():
    importers = sorted(m for m, edges in _imports().items() if any(t == "cli" for t, _, _ in edges))
    assert importers == ["__main__"]


def test_the_layer_contract_holds():
    """import-linter (in the test extra) checks the contracts of pyproject.toml against this checkout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    lint = pathlib.Path(sys.executable).with_name("lint-imports")
    command = [str(lint)] if lint.exists() else [sys.executable, "-m", "importlinter.cli"]
    proc = subprocess.run(command + ["--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_the_contract_sees_function_level_imports():
    """The contract's premise: grimp's graph holds imports made inside functions (explore.probe's library)."""
    import grimp

    graph = grimp.build_graph("paracheck", cache_dir=None)
    assert graph.direct_import_exists(importer="paracheck.explore", imported="paracheck.library")
