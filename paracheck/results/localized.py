"""A case's `localization` (docs/reports.md, "Localization") read into the one shape the HTML report draws.

The schema's names are read first; the rank side's own names for the same things are accepted too (an
entry's `module` or `param` for `name`, `within` for `ok`, a `first` or `last_agreeing` that is the module's
whole entry rather than its name), so a report from either side of that seam renders. Anything else that
is not what the schema says is dropped, never raised on. Torch-free.
"""

from __future__ import annotations

from paracheck.results.plots import ints, items, number

#: The parts that are forward-like (module by module), in the order the page shows them.
FORWARD_PARTS = (("forward", "Forward"), ("inference", "No-grad forward"), ("generate", "Generation"))


def read(localization) -> dict:
    """{"forward": ..., "inference": ..., "grads": ..., "steps": ...}, each part only where the report has it."""
    if not isinstance(localization, dict):
        return {}
    out = {}
    for part, _ in FORWARD_PARTS:
        if isinstance(localization.get(part), dict):
            out[part] = forward(localization[part])
    if isinstance(localization.get("grads"), dict):
        out["grads"] = grads(localization["grads"])
    if isinstance(localization.get("steps"), dict) and not localization["steps"].get("error"):
        out["steps"] = steps(localization["steps"])
    return out


def steps(part: dict) -> dict:
    """A failing parity.steps' rerun of its first parting step: its words, and its forward and gradients read as
    those parts are."""
    from paracheck.results.localization import steps_line

    try:
        words = steps_line(part)
    except (KeyError, TypeError):  # a report from elsewhere, short of what the line names
        words = None
    return {"step": number(part.get("step")), "of": number(part.get("of")), "where": text(part.get("where")),
            "line": words, "ranks": ints(part.get("ranks")),
            "forward": forward(part["forward"]) if isinstance(part.get("forward"), dict) else None,
            "grads": grads(part["grads"]) if isinstance(part.get("grads"), dict) else None}


def forward(part: dict) -> dict:
    return {"atol": number(part.get("atol")), "rtol": number(part.get("rtol")),
            "first": label(part.get("first")), "last_agreeing": label(part.get("last_agreeing")),
            "origin": label(part.get("origin")), "modules": [entry(m) for m in items(part.get("modules"))],
            "not_compared": [{"name": name(m), "why": text(m.get("why"))} for m in items(part.get("not_compared"))],
            "ranks": ints(part.get("ranks")), "decode_step": number(part.get("decode_step")),
            "mode": text(part.get("mode"))}


def grads(part: dict) -> dict:
    return {"params": [entry(p) for p in items(part.get("params"))], "pattern": text(part.get("pattern")),
            "origin": label(part.get("origin")), "ranks": ints(part.get("ranks"))}


def entry(e: dict) -> dict:
    return {"name": name(e), "max_abs": number(e.get("max_abs")), "max_rel": number(e.get("max_rel")),
            "ok": ok(e), "why": text(e.get("why"))}


def name(e: dict) -> str:
    for key in ("name", "module", "param"):
        if e.get(key) is not None:
            return str(e[key])
    return "?"


def label(value) -> str | None:
    """A module's name, given as the name or as its entry."""
    if isinstance(value, dict):
        return name(value)
    return None if value is None else str(value)


def ok(e: dict) -> bool | None:
    for key in ("ok", "within"):
        if isinstance(e.get(key), bool):
            return e[key]
    return None


def text(value) -> str | None:
    return None if value is None else str(value)
