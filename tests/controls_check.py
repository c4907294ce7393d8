"""Every control an adapter registers is asserted detected, read from the registry (`paracheck.adapters.controls`),
so a control added there cannot pass unnoticed as inconclusive or skipped."""

from paracheck.domain.registry import controls
from paracheck.adapters.diffusers.layout import DiffusersLayout


def undetected(report_cases: list[dict], library: str, elsewhere=()) -> list[str]:
    """What is wrong with the controls of `library` in a run's JSON cases: each registered control must have a
    detected case; none may be missed; and wherever it applies (its layout and route) and its plain case
    passed, it must be detected (inconclusive is only for a plain case that is itself a declared failure)."""
    registry = {name: c for name, c in controls(library).items() if name not in elsewhere}  # asserted by other runs
    problems = [] if registry else [f"no controls registered for {library}"]
    plain = {(c["model"], c["layout"], c.get("variant", "base")): c["status"] for c in report_cases if not c["control"]}
    for name, control in registry.items():
        mine = [c for c in report_cases if c["control"] == name]
        if not any(c["status"] == "detected" for c in mine):
            problems.append(f"{name}: no detected case among {len(mine)}")
        for c in mine:
            where = f"{name} on {c['model']} {c['layout']} {c.get('variant', 'base')}"
            if c["status"] == "missed":
                problems.append(f"{where}: missed ({c['reason']})")
            applies = control.skip_reason(DiffusersLayout.parse(c["layout"], c.get("order") or "cp-fastest"), c.get("route") or None) is None
            if applies and plain.get((c["model"], c["layout"], c.get("variant", "base"))) == "pass" \
                    and c["status"] != "detected":
                problems.append(f"{where}: {c['status']} though it applies and the plain case passed ({c['reason']})")
    return problems
