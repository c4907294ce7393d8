"""Markdown tables for docs/topology.md from `paracheck topology --simulate --report-json` files.

    python benchmarks/topology_tables.py REPORT.json [REPORT.json ...]

One table per model and backend: a row per world size, the layouts that simulate ok, and the others
grouped by reason (the model's head count, a missing plan, the platform's group rules, a structure check).
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict


def reason_key(result: dict) -> str:
    if result["status"] == "unfit":
        text = result["reason"]
        if "no _tp_plan" in text:
            return "no `_tp_plan` (TP)"
        match = re.match(r"(\d+) heads: tp x ulysses = (\d+)", text)
        if match:
            return f"{match.group(1)} heads: tp x ulysses must divide them"
        return text
    keys = []
    for check, failure in result["failures"].items():
        detail = failure["detail"]
        if check == "backend.groups":
            if "strided" in detail:
                keys.append("all-to-all group strided")
            size = re.search(r"all-to-all group of (\d+) ranks", detail)
            if size:
                keys.append(f"all-to-all group of {size.group(1)}")
        else:
            keys.append(f"{check} fails")
    if not keys and result["status"] == "no":
        keys.append(result["reason"][:60])
    return "; ".join(keys) or result["status"]


def _head_multiple(name: str) -> int:
    degrees = dict(re.findall(r"(tp|r|u)(\d+)", name))
    return int(degrees.get("tp", 1)) * int(degrees.get("u", 1))


def tables(paths: list[str]) -> str:
    rows = defaultdict(dict)  # (model, heads, backend, order) -> world -> data
    for path in paths:
        with open(path) as handle:
            data = json.load(handle)
        for model in data["models"]:
            key = (model["model"], model["class"], model["heads"], model.get("backend") or data["backend"],
                   data["order"])
            rows[key][data["world"]] = model["results"]
    out = []
    for (model, cls, heads, backend, order), worlds in sorted(rows.items()):
        out.append(f"**{model}** (`{cls}`, {heads} heads) on **{backend}**, order {order}\n")
        out.append("| world | ok | cannot run (why) | ranks simulated | ms/rank CPU |")
        out.append("| ---: | --- | --- | ---: | ---: |")
        for world in sorted(worlds):
            results = worlds[world]
            ok = [r["layout"] for r in results if r["status"] == "ok"]
            grouped = defaultdict(list)
            for r in results:
                if r["status"] != "ok":
                    grouped[reason_key(r)].append(r["layout"])
            parts = []
            for reason, names in grouped.items():
                if reason.startswith("no `_tp_plan`"):
                    parts.append(f"{len(names)} layouts with tp > 1: {reason}")
                elif "heads: tp x ulysses" in reason:
                    products = sorted({_head_multiple(name) for name in names})
                    parts.append(f"{len(names)} layouts with tp x ulysses in {{{', '.join(map(str, products))}}}: "
                                 f"{reason.split(':')[0]} are not a multiple")
                else:
                    parts.append(f"{', '.join(names)}: {reason}")
            why = "<br>".join(parts)
            ranks = sum(r["ranks"] for r in results)
            cpu = sum(r.get("cpu_seconds", 0) for r in results)
            per = f"{1000 * cpu / ranks:.0f}" if ranks else "-"
            out.append(f"| {world} | {', '.join(ok) or '-'} | {why or '-'} | {ranks} | {per} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(tables(sys.argv[1:]))
