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


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name under it ("worker", "cli.common"), packages as their name."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        if any((PACKAGE / p).is_symlink() for p in path.relative_to(PACKAGE).parents):
            continue  # a checkout may link fixtures/ in; it is not the package's code
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules) -> str | None:
    """The package module `name` is, or is inside (a name imported from a module); None outside the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports() -> dict[str, list[tuple[str, str, int]]]:
    """module -> [(imported module, name or "", line)] for every import in it, at any depth of the file."""
    modules = _modules()
    found: dict[str, list[tuple[str, str, int]]] = {}
    for m, path in sorted(modules.items()):
        here = m.split(".") if path.name == "__init__.py" else m.split(".")[:-1]
        edges = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - (node.level - 1)] + ([node.module] if node.module else [])
                elif node.module == "paracheck" or (node.module or "").startswith("paracheck."):
                    base = node.module.split(".")[1:]
                else:
                    continue
                for alias in node.names:
                    target = _resolve(".".join(base + [alias.name]), modules) or _resolve(".".join(base), modules)
                    if target:
                        edges.append((target, alias.name, node.lineno))
            elif isinstance(node, ast.Import):
                edges += [(t, "", node.lineno) for a in node.names if a.name.startswith("paracheck.")
                          for t in [_resolve(a.name.partition(".")[2], modules)] if t]
        found[m] = [e for e in edges if e[0] != m]
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
    # The premise: an import made inside a function is an edge (the adapter reaches its rank side in one).
    assert "adapters.diffusers.body" in graph["adapters.diffusers.adapter"]
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_is_imported_across_modules():
    private = [f"{m}:{line} imports {target}.{name}" for m, edges in _imports().items()
               for target, name, line in edges if name.startswith("_") and not name.startswith("__")]
    assert private == []


def _command_line(module: str) -> bool:
    """The commands (flat: cli, explore_cli, simulate_cli; by role: cli.*), not their shared leaf."""
    if module in ("cli_common", "cli.common"):
        return False
    return module in ("cli", "explore_cli", "simulate_cli") or module.startswith("cli.")


def test_nothing_but_the_entry_point_imports_the_command_line():
    importers = sorted(m for m, edges in _imports().items() if not _command_line(m)
                       and any(_command_line(t) for t, _, _ in edges))
    assert importers == ["__main__"]


def test_the_layer_contract_holds():
    """import-linter (in the test extra) checks the contracts of pyproject.toml against this checkout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # The installed CLI's own function, run by this interpreter: `python -m importlinter.cli` runs nothing (the module
    # has no __main__), and a `lint-imports` beside the interpreter is absent in a venv over another site-packages.
    command = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
               "sys.exit(lint_imports_command())"]
    proc = subprocess.run(command + ["--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_the_contract_sees_function_level_imports():
    """The contract's premise: grimp's graph holds imports made inside functions (explore.probe's library)."""
    import grimp

    graph = grimp.build_graph("paracheck", cache_dir=None)
    assert graph.direct_import_exists(importer="paracheck.adapters.diffusers.adapter",
                                      imported="paracheck.adapters.diffusers.body")


#: The host's layers: none of them may name a library or import an adapter (the layers contract holds the imports).
GENERIC = ("domain", "checks", "world", "launch", "results", "rank", "explore", "pytest", "cli", "testing")


def _code_strings(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant in a module but its docstrings: what the code itself says."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]


def _named_libraries(modules: dict) -> list[str]:
    from paracheck.domain.registry import adapters

    libraries = [name for name in adapters() if name != "torch"]  # the torch adapter is named after torch itself
    return [f"{m}:{line}: {text[:60]!r}" for m, path in sorted(modules.items())
            if m.split(".")[0] in GENERIC for line, text in _code_strings(path)
            if any(library in text for library in libraries)]


def test_no_generic_layer_names_a_library():
    assert _named_libraries(_modules()) == []


def test_the_library_name_finder_finds_one(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""Docstrings may say diffusers."""\nDEFAULT = "diffusers"\n')
    assert _named_libraries({"domain.planted": planted}) == ["domain.planted:2: 'diffusers'"]


def test_no_name_is_undefined():
    """Every name the package's code reads is bound (pyflakes' undefined-name rule): an import lost in a merge
    fails here, in process, and not as every rank's NameError in a world."""
    from pyflakes import checker, messages

    undefined = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)
    found = [str(m) for path in sorted(PACKAGE.rglob("*.py"))
             for m in checker.Checker(ast.parse(path.read_text()), filename=str(path)).messages
             if isinstance(m, undefined)]
    assert found == []
