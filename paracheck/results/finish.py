"""The end of `paracheck run`, launched or under torchrun: every case judged, the table, notes and
summary printed, the reports written; returns the exit code."""

from __future__ import annotations

from paracheck.results import report
from paracheck.results.runmeta import RunMeta


def finish(args, verdicts, events, meta: RunMeta, seconds: float, extra: str, carried=(), not_run=()) -> int:
    """The table, notes and reports of every case's verdict (each judged once, as it finished: `Progress`);
    returns the exit code. `carried`: the cases a `--resume` report held, written into this run's report;
    `not_run`: the ids of the cases an interrupted run never finished."""
    base = [] if args.backend == "auto" else ["--backend", args.backend]
    local = getattr(args, "local_world", None)
    if local:  # also for an interrupted run: the share of what it finished
        meta = meta.with_extra(local_world=report.local_share(verdicts, local))
    base += (["--local-world", str(local)] if local else ["--nproc", str(args.nproc)]) + (
        ["--no-grads"] if args.no_grads else [])
    replays = {v.id: report.replay_command(v, base) for v in verdicts}
    print(report.table(verdicts))
    text = report.notes(verdicts, replays)
    if text:
        print("\n" + text)
    for event in events:
        declared = report.declared_hang(event, verdicts)  # expected: said so, and no exit code 3 for it
        print(f"\n{'declared hang (xfail)' if declared else f'RUN BROKE ({event.kind})'}: {event.message}")
    data = report.to_json(verdicts, meta, events, replays, carried, not_run)
    print("\n" + report.counts_line(verdicts, seconds, meta.worlds or 1, extra))
    if "local_world" in meta.extra:
        print(report.local_line(meta.extra["local_world"]))
    if carried:
        print(f"{len(carried)} cases carried from --resume {args.resume} (not run again; in the JSON report)")
    if args.report_json:
        report.write_report(args.report_json, data)
    if args.junit:
        report.write_report(args.junit, report.to_junit(verdicts))
    if getattr(args, "html", None):
        from paracheck.results.html import render

        report.write_report(args.html, render(data))
    return data["exit_code"]


def interrupted(args, done: list, not_run: list[str], meta: RunMeta, seconds: float, how: str, extra: str = "",
                carried=()) -> int:
    """A run stopped by `how` (SIGINT, SIGTERM) before its end: the table and reports of every case that finished
    (`done`, those decided before launch among them), the others named as not run (`not_run`, their ids), and the
    command that goes on from the JSON report; exit 3."""
    from paracheck.domain.records import RunEvent

    goes_on = f"; go on with --resume {args.report_json}" if args.report_json else " (no --report-json to resume from)"
    event = RunEvent("interrupted", None, f"{how}: {len(done)} of {len(done) + len(not_run)} cases finished, "
                                          f"{len(not_run)} not run{goes_on}")
    return finish(args, done, [event], meta, seconds, extra, carried, not_run)
