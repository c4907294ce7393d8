"""A report for the HTML tests: a real tiny run's JSON (one detected control), plus hand-built cases of
the other statuses, a failing one carrying the localization block docs/reports.md specifies."""

from __future__ import annotations

import copy

#: Modules of the hand-built forward localization, in execution order; it diverges at FIRST.
MODULES = ["x_embedder", "context_embedder", "time_text_embed"] + \
    [f"transformer_blocks.{i}.{part}" for i in range(2) for part in ("norm1", "attn", "ff")] + \
    [f"single_transformer_blocks.{i}.{part}" for i in range(2) for part in ("norm", "attn", "proj_out")] + \
    ["norm_out", "proj_out"]
FIRST = "transformer_blocks.1.attn"
ATOL = RTOL = 1e-5


def localization() -> dict:
    """Forward agrees to 1e-7 until FIRST, then grows; one module exact (0.0); one parameter NaN. In the report's
    own spelling (docs/reports.md, "Localization"), as a merged case carries it."""
    first = MODULES.index(FIRST)
    modules = []
    for i, name in enumerate(MODULES):
        err = 0.0 if name == "time_text_embed" else (1.2e-7 if i < first else 3e-3 * 2 ** (i - first))
        modules.append({"module": name, "max_abs": err, "max_rel": err / 2, "within": i < first})
    params = [{"param": f"transformer_blocks.1.attn.to_{p}.weight", "max_abs": 0.5 / (k + 1),
               "max_rel": 0.1 / (k + 1), "within": False, "over": 2.0} for k, p in enumerate("qkv")]
    params.insert(0, {"param": "proj_out.weight", "max_abs": float("nan"), "max_rel": float("nan"), "within": False,
                      "over": None})
    params += [{"param": f"x_embedder.{p}", "max_abs": 1e-8, "max_rel": 2e-8, "within": True, "over": 1e-3}
               for p in ("weight", "bias")]
    return {"forward": {"modules": modules, "first": modules[first], "last_agreeing": modules[first - 1],
                        "origin": FIRST,
                        "not_compared": [{"module": "pos_embed", "why": "returns a tuple of rotary tables"}],
                        "atol": ATOL, "rtol": RTOL, "pass": "training", "rank": 0, "ranks": [0, 1], "other_ranks": {}},
            "grads": {"params": params, "pattern": "every attention weight of block 1 and after; none before",
                      "origin": "proj_out.weight", "rank": 1, "ranks": [1], "other_ranks": {}}}


def _set_check(case: dict, check_id: str, status: str, max_abs: float, ranks: list[int], detail: str) -> None:
    for check in case["checks"]:
        if check["id"] == check_id:
            check.update(status=status, max_abs=max_abs, max_rel=max_abs / 2, failed_ranks=ranks, detail=detail)


def sample(report: dict) -> dict:
    """`report` (a real run's) with five hand-built cases added: fail (localized), xfail (grads localized),
    error, pass and skip, on other models and layouts than the real case's."""
    real = report["cases"][0]
    data = copy.deepcopy(report)

    def made(**fields) -> dict:
        case = copy.deepcopy(real)
        case.pop("localization", None)  # the real control's own (a detected control is localized too)
        case.update(control=None, **fields)
        return case

    fail = made(id="flux2-u2-native", model="flux2", layout="u2", status="fail",
                reason="failed: parity.forward, parity.grads", replay="paracheck run --models flux2 --layouts u2",
                localization=localization())
    _set_check(fail, "parity.forward", "fail", 0.096, [0, 1], f"max_abs 9.6e-02 beyond atol 1e-05 ({FIRST})")
    _set_check(fail, "parity.grads", "fail", 0.5, [1], "3 grads differ")
    xfail = made(id="wan-r2-native", model="wan", layout="r2", status="xfail",
                 reason="known upstream failure: ring backward (failed: parity.grads)",
                 known_failure="ring backward rotates the wrong way [lib 1.0]",
                 replay="paracheck run --models wan --layouts r2", localization={"grads": localization()["grads"]})
    _set_check(xfail, "parity.grads", "fail", 0.5, [0, 1], "3 grads differ")
    # As the skeleton reports a raise: the pass named in the reason, and that pass's check failing with it.
    error = made(id="wan-u2-native", model="wan", layout="u2", status="error",
                 reason="rank 1: forward: RuntimeError: planted", error_ranks=[1], secondary_ranks=[0],
                 traceback="Traceback (most recent call last):\nRuntimeError: planted", stacks={})
    error["checks"] = [dict(c, status="pass", failed_ranks=[], detail="") for c in error["checks"]
                       if c["id"].startswith("structure.")]
    error["checks"].append(dict(id="parity.forward", status="fail", failed_ranks=[1], max_abs=None, max_rel=None,
                                atol=None, rtol=None, detail="forward raised RuntimeError: planted", data={}))
    passed = made(id="flux-u2-native", layout="u2", status="pass", reason="")
    for check in passed["checks"]:
        check.update(status="pass", failed_ranks=[], detail="")
    skipped = made(id="wan-tp2-auto", model="wan", layout="tp2", route="auto", status="skip", checks=[],
                   reason="WanTransformer3DModel has no _tp_plan")
    data["cases"] = [passed, skipped, *data["cases"], xfail, error, fail]
    data["summary"] = dict(data["summary"], passed=1, failed=1, errors=1, skipped=1, xfailed=1)
    data["exit_code"] = 1
    return data
