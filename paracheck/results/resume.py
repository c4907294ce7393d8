"""`--resume REPORT.json`: the cases an earlier report holds, and what a run carries over from it. Torch-free.

A report holds a case when it has the case's verdict and that verdict is not `error` (a case that raised, or whose
world broke under it, runs again). The cases an interrupted run never finished are listed under `not_run`, not
under `cases`, so they run again too. The resumed run leaves the held cases out and writes them into its own
report beside the cases it ran, so the last report of a chain of resumes is the whole run's.
"""

from __future__ import annotations

import json

#: The JSON report's list of the cases an interrupted run never finished (case ids, in the run's order).
NOT_RUN = "not_run"


class ResumeError(ValueError):
    """A --resume report that cannot be read."""


def case_key(case) -> tuple:
    """What makes a case the same case in another run: everything its id is made of but the route, which a
    report holds resolved (`auto` became `native` or `composed`), and the dtype, order and options it ran with."""
    return _key(case.model, case.layout.name, case.layout.order, case.variant, case.dtype, case.control,
                dict(case.cp_options))


def _json_key(data: dict) -> tuple:
    return _key(data["model"], data["layout"], data.get("order") or "cp-fastest", data.get("variant") or "base",
                data.get("dtype") or "fp32", data.get("control"), data.get("cp_options") or {})


def _key(model, layout, order, variant, dtype, control, options: dict) -> tuple:
    return (model, layout, order, variant, dtype, control, tuple(sorted((k, str(v)) for k, v in options.items())))


def held(path: str) -> dict[tuple, dict]:
    """The cases the report at `path` holds (all but errors), by `case_key`, as the report wrote them."""
    try:
        with open(path) as handle:
            data = json.load(handle)
        return {_json_key(c): c for c in data["cases"] if c.get("status") != "error"}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ResumeError(f"--resume {path}: not a paracheck JSON report ({type(exc).__name__}: {exc})") from exc


def left(cases: list, holding: dict[tuple, dict]) -> tuple[list, list[dict]]:
    """The cases still to run, and the report's entries for the others (in the order of `cases`)."""
    todo, carried = [], []
    for case in cases:
        entry = holding.get(case_key(case))
        if entry is None:
            todo.append(case)
        else:
            carried.append(entry)
    return todo, carried
