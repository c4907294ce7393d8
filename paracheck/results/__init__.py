"""From rank results to a report: the judge pipeline, known failures, report, progress."""
