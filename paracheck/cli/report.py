"""`paracheck report RUN.json --html PATH`: a report of an earlier run, from its JSON report, as the one
self-contained HTML page `paracheck run --html` writes (`results.html`). Torch-free: it reads a file."""

from __future__ import annotations

import json

from paracheck.cli.common import UsageError, check_writable
from paracheck.launch.protocol import Exit


def add_parser(sub) -> None:
    report = sub.add_parser("report", help="write the HTML report of a JSON report (paracheck run --report-json)")
    report.add_argument("json", metavar="RUN.json", help="a JSON report written by paracheck run --report-json")
    report.add_argument("--html", required=True, help="write the HTML report here (one self-contained file)")


def read(path: str) -> dict:
    """The report in `path`; a `UsageError` naming the path and what is wrong with it."""
    from paracheck.results.html import ReportError, check_report

    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as exc:
        raise UsageError(f"report {path}: cannot read it ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"report {path}: not a JSON report: not UTF-8 text ({exc.reason} at byte {exc.start})") \
            from exc
    except json.JSONDecodeError as exc:
        raise UsageError(f"report {path}: not a JSON report: invalid JSON at line {exc.lineno} column {exc.colno} "
                         f"({exc.msg})") from exc
    try:
        check_report(data)
    except ReportError as exc:
        raise UsageError(f"report {path}: {exc}") from exc
    return data


def report(args) -> int:
    from paracheck.results.html import render
    from paracheck.results.report import write_report

    check_writable(args.html, "--html")
    data = read(args.json)
    write_report(args.html, render(data))
    print(f"paracheck: wrote {args.html} ({len(data['cases'])} cases)")
    return Exit.OK
