"""The end of `paracheck run`, launched or under torchrun: every case judged, the table, notes and
summary printed, the reports written; returns the exit code."""

from __future__ import annotations

from paracheck.results import report


def finish(args, verdicts, events, meta: dict, seconds: float, extra: str) -> int:
    """The table, notes and reports of every case's verdict (each judged once, as it finished: `Progress`);
    returns the exit code."""
    base = [] if args.backend == "auto" else ["--backend", args.backend]
    base += ["--nproc", str(args.nproc)] + (["--no-grads"] if args.no_grads else [])
    replays = {v.id: report.replay_command(v, base) for v in verdicts}
    print(report.table(verdicts))
    text = report.notes(verdicts, replays)
    if text:
        print("\n" + text)
    for event in events:
        print(f"\nRUN BROKE ({event.kind}): {event.message}")
    data = report.to_json(verdicts, meta, events, replays)
    print("\n" + report.counts_line(verdicts, seconds, meta.get("worlds", 1), extra))
    if args.report_json:
        report.write_report(args.report_json, data)
    if args.junit:
        report.write_report(args.junit, report.to_junit(verdicts))
    if getattr(args, "html", None):
        from paracheck.results.html import render

        report.write_report(args.html, render(data))
    return data["exit_code"]
