#!/usr/bin/env python3
"""Move paracheck's flat modules into subpackages by role (issue 19), as `git mv` plus import rewriting.

One-shot migration, kept until it is applied. Run from the repository root of a clean checkout:
    python3 scripts/restructure_into_subpackages.py [--dry-run]
Tried on the tree before meshes.py, control.py and the transformers adapter merged: every module
imported, lint-imports held, the fast tests passed; the full suite was not run on the moved tree. Add
rows for meshes.py and control.py first; `pip install -e .` again afterwards (entry points move).

Driven by MOVES (old module -> new dotted module under `paracheck`); add a row for every module other
branches created (e.g. adapters/transformers/*, a mesh-cache module) before running. What it does:
  1. `git mv` each module (and known_failures.toml beside known.py), creating the packages' __init__.py;
  2. rewrites every `paracheck.OLD` dotted reference (absolute imports, strings such as "paracheck.rank.worker"
     or "paracheck.cli.main:main", mock targets, docs) in .py/.md/.toml/.yml/.cfg files of the checkout;
  3. rewrites every relative import inside the package (`from .x import y`, `from . import x`) into an
     absolute one, one statement per target module (function-level imports included, indentation kept);
  4. rewrites `from paracheck import OLD` into `from paracheck.PARENT import NEW as OLD`;
  5. pyproject.toml: the packages list, package data; docs/architecture.md: `old.py` -> `role/new.py`.
Modules not in MOVES stay where they are. Run it once: the text rewriting is not idempotent.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

PACKAGE = "paracheck"

#: old flat module -> new module (dotted, under paracheck). The one table to edit.
MOVES = {
    # domain: torch-free records and rules every layer shares
    "layout": "domain.layout",
    "backends": "domain.backends",
    "shapes": "domain.shapes",
    "records": "domain.records",
    "case": "domain.case",
    "fixtures_index": "domain.fixtures_index",
    "control": "domain.control",
    # adapters/diffusers: everything that knows diffusers' privates and plans
    "library": "adapters.diffusers.library",
    "routes": "adapters.diffusers.routes",
    "fitting": "adapters.diffusers.fitting",
    "attention": "adapters.diffusers.attention",
    # rank: what a rank does per case
    "worker": "rank.worker",
    "reference": "rank.reference",
    "meshes": "rank.meshes",
    "preload": "rank.preload",
    "torchrun": "rank.torchrun",
    # checks: the registry, comparison, structure, collectives, shard arithmetic, controls
    "checks": "checks.registry",
    "collectives": "checks.collectives",
    "shardledger": "checks.shardledger",
    "controls": "checks.controls",
    # launch: torch-free launcher side and the protocol
    "protocol": "launch.protocol",
    "supervisor": "launch.supervisor",
    "rankstart": "launch.rankstart",
    "launch": "launch.launcher",
    "attribution": "launch.attribution",
    # results: the judge pipeline, known failures, report, progress, the end of a run
    "verdict": "results.verdict",
    "known": "results.known",
    "report": "results.report",
    "progress": "results.progress",
    "finish": "results.finish",
    # explore and simulate
    "explore": "explore.engine",
    "found": "explore.found",
    "simulate": "simulate.engine",
    "fakeworld": "simulate.fakeworld",
    "sim_specs": "simulate.specs",
    # the command line: a leaf `common`, one module per command
    "cli": "cli.main",
    "cli_common": "cli.common",
    "explore_cli": "cli.explore",
    "simulate_cli": "cli.topology",
    # pytest: mixins, plugin, payload
    # "testing" stays: `paracheck.testing` is the import path the contract gives users for the mixins.
    "plugin": "pytest.plugin",
    "payload": "pytest.payload",
}
#: Data files that travel with a module (old module -> file names beside it).
DATA = {"known": ["known_failures.toml"]}
#: What each new package's __init__.py says it holds (its first docstring line).
PACKAGES = {
    "domain": "Torch-free records and rules every layer shares: layouts, backends, shapes, cases, check ids.",
    "adapters": "Library adapters: everything one parallel library's private state and plans need.",
    "adapters.diffusers": "The diffusers adapter: its private attributes, routes, fitting and attention backend.",
    "rank": "The rank side: planning, references and the steps of one case on one rank.",
    "checks": "The checks: registry and comparison rules, structure, collectives, TP shards, negative controls.",
    "launch": "The launcher side (torch-free): the run protocol, starting and watching worlds, attribution.",
    "results": "From rank results to a report: the judge pipeline, known failures, report, progress.",
    "explore": "`paracheck explore`: hypothesis draws, the probe, hunts, found cases.",
    "simulate": "`topology --simulate`: a layout's ranks on meta in one process.",
    "cli": "The command line: `common` (the leaf every command shares), one module per command.",
    "pytest": "pytest integration: the mixins, the plugin, the payload handed to ranks.",
}
TEXT_SUFFIXES = (".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".txt", ".ini")
SKIP_DIRS = {".git", "__pycache__", ".venv", "node_modules", ".hypothesis", "build", "dist"}


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def move_files(dry: bool) -> dict[str, str]:
    """git mv every module still at its old place; returns the moves done (old -> new)."""
    done = {}
    for old, new in MOVES.items():
        src = os.path.join(PACKAGE, f"{old}.py")
        if not os.path.exists(src):
            continue
        dst = os.path.join(PACKAGE, *new.split(".")) + ".py"
        done[old] = new
        if dry:
            print(f"git mv {src} {dst}")
            continue
        _make_packages(os.path.dirname(dst))
        run("git", "mv", src, dst)
        for name in DATA.get(old, []):
            if os.path.exists(os.path.join(PACKAGE, name)):
                run("git", "mv", os.path.join(PACKAGE, name), os.path.join(os.path.dirname(dst), name))
    return done


def _make_packages(folder: str) -> None:
    parts = os.path.relpath(folder, PACKAGE).split(os.sep)
    for i in range(1, len(parts) + 1):
        path = os.path.join(PACKAGE, *parts[:i])
        os.makedirs(path, exist_ok=True)
        init = os.path.join(path, "__init__.py")
        if not os.path.exists(init):
            doc = PACKAGES.get(".".join(parts[:i]), "Part of paracheck.")
            with open(init, "w") as handle:
                handle.write(f'"""{doc}"""\n')
            run("git", "add", init)


def text_files():
    for folder, dirs, files in os.walk("."):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not os.path.islink(os.path.join(folder, d))]
        for name in files:
            if name.endswith(TEXT_SUFFIXES):
                yield os.path.join(folder, name)


def rewrite_dotted(text: str, moves: dict[str, str]) -> str:
    """`paracheck.OLD` -> `paracheck.NEW` wherever it is spelled (imports, strings, entry points, docs)."""
    if not moves:
        return text
    names = "|".join(sorted(map(re.escape, moves), key=len, reverse=True))
    return re.sub(rf"\b{PACKAGE}\.({names})\b(?![\w/])", lambda m: f"{PACKAGE}.{moves[m.group(1)]}", text)


def module_of(path: str) -> str | None:
    """The dotted module a file under the package is (after the move), or None outside it."""
    rel = os.path.relpath(path, ".")
    if not rel.startswith(PACKAGE + os.sep) or not rel.endswith(".py"):
        return None
    parts = rel[:-3].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def rewrite_imports(text: str, module: str | None, moves: dict[str, str], is_package: bool) -> str:
    """Relative imports inside the package, and `from paracheck import OLD`, made absolute and moved."""
    moved_from = {f"{PACKAGE}.{new}": f"{PACKAGE}.{old}" for old, new in moves.items()}
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level and module is None:
            continue
        if node.level:
            # Relative spellings mean what they meant where the file was: a moved module sat flat in the
            # package; a file this script did not move (another branch's subpackage) is where it was.
            where = moved_from.get(module, module)
            base = where.split(".") if is_package else where.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        elif node.module == PACKAGE or (node.module or "").startswith(PACKAGE + "."):
            target = node.module
            if target != PACKAGE:
                continue  # dotted absolute forms were rewritten by rewrite_dotted
        else:
            continue
        edits.append((node, _statements(target, node.names, moves)))
    for node, new in sorted(edits, key=lambda e: e[0].lineno, reverse=True):
        indent = " " * node.col_offset
        start, end = node.lineno - 1, node.end_lineno
        first = lines[start]
        prefix = first[:node.col_offset]
        if prefix.strip():  # `try: from . import x` on one line: leave it for a person
            continue
        lines[start:end] = [indent + s + "\n" for s in new]
    return "".join(lines)


def _statements(target: str, names, moves: dict[str, str]) -> list[str]:
    """Absolute import statements for `from TARGET import names` after the moves."""
    out: list[str] = []
    if target == PACKAGE:
        plain = []
        for alias in names:
            if alias.name in moves:
                parent, _, leaf = f"{PACKAGE}.{moves[alias.name]}".rpartition(".")
                local = alias.asname or alias.name
                out.append(f"from {parent} import {leaf}" + (f" as {local}" if local != leaf else ""))
            else:
                plain.append(alias)
        if plain:
            out.insert(0, f"from {PACKAGE} import " + ", ".join(_alias(a) for a in plain))
        return out
    old = target[len(PACKAGE) + 1:]
    head, _, rest = old.partition(".")
    new = f"{PACKAGE}.{moves[head]}" + (f".{rest}" if rest else "") if head in moves else target
    return _wrap(f"from {new} import ", [_alias(a) for a in names])


def _alias(alias) -> str:
    return alias.name + (f" as {alias.asname}" if alias.asname else "")


def _wrap(head: str, parts: list[str], width: int = 116) -> list[str]:
    """One statement, wrapped in parentheses over lines of at most `width` (the indent comes later)."""
    line = head + ", ".join(parts)
    if len(line) <= width:
        return [line]
    lines, current = [], head + "("
    for i, part in enumerate(parts):
        piece = part + (", " if i < len(parts) - 1 else ")")
        if len(current) + len(piece.rstrip()) > width and current.strip() not in (head.strip() + "(",):
            lines.append(current.rstrip())
            current = " " * len(head + "(")
        current += piece
    return lines + [current]


def fix_pyproject(moves: dict[str, str]) -> None:
    path = "pyproject.toml"
    text = open(path).read()
    packages = sorted({PACKAGE} | {f"{PACKAGE}." + ".".join(n.split(".")[:i]) for n in moves.values()
                                   for i in range(1, len(n.split(".")))})
    listed = ", ".join(f'"{p}"' for p in packages + [f"{PACKAGE}.fixtures"])
    text = re.sub(r'packages = \[[^\]]*\]', f"packages = [{listed}]", text, count=1)
    for old, files in DATA.items():
        if old in moves:
            parent = f"{PACKAGE}." + moves[old].rpartition(".")[0]
            names = ", ".join(f'"{f}"' for f in files)
            text = re.sub(rf'^{PACKAGE} = \[{re.escape(names)}\]', f'"{parent}" = [{names}]', text, flags=re.M)
    open(path, "w").write(text)


def fix_docs(moves: dict[str, str]) -> None:
    path = os.path.join("docs", "architecture.md")
    if not os.path.exists(path):
        return
    text = open(path).read()
    names = "|".join(sorted(map(re.escape, moves), key=len, reverse=True))
    text = re.sub(rf"`({names})\.py`", lambda m: f"`{moves[m.group(1)].replace('.', '/')}.py`", text)
    text = text.replace("## Module map (`paracheck/`)", "## Module map (`paracheck/`, by role)")
    open(path, "w").write(text)


def main(argv) -> int:
    dry = "--dry-run" in argv
    moves = move_files(dry)
    if dry or not moves:
        print(f"{len(moves)} modules to move" if dry else "nothing to move")
        return 0
    for path in text_files():
        text = open(path, encoding="utf-8").read()
        new = rewrite_dotted(text, moves)
        if path.endswith(".py"):
            module = module_of(path)
            is_package = path.endswith("__init__.py")
            try:
                new = rewrite_imports(new, module, moves, is_package)
            except SyntaxError as exc:
                print(f"skipped imports of {path}: {exc}", file=sys.stderr)
        if new != text:
            open(path, "w", encoding="utf-8").write(new)
    fix_pyproject(moves)
    fix_docs(moves)
    print(f"moved {len(moves)} modules; review `git diff --stat -M` and run the suite")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
