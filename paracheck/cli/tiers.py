"""Which tier `paracheck run` runs: the quick tier (`domain.tier`) by default, the whole matrix on `--all` or when
`--variants` names the inputs to run."""

from __future__ import annotations

from paracheck.domain import registry


def add_all(parser) -> None:
    parser.add_argument("--all", action="store_true", help="the whole matrix: every variant of every model on every "
                        "layout (default: the quick tier, every model and layout with one variant each, every "
                        "(model, variant) and (layout kind, variant) pair and every declared known failure met once)")


def add_training(parser) -> None:
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps parity.steps takes "
                        f"(default {DEFAULT_STEPS}; 0: no parity.steps); the default tier takes them on one layout of "
                        "each kind of parallelism per library, --all on every layout")
    parser.add_argument("--no-checkpoint", action="store_true", help="skip checkpoint.roundtrip")


#: parity.steps' optimizer steps by default (the contract's N).
DEFAULT_STEPS = 3


def choose(args, cases: list) -> list:
    """`cases` as built (the full matrix), or their quick tier; then parity.steps and checkpoint.roundtrip turned on
    on one layout of each kind (`domain.tier.with_training`), and parity.generate likewise on the cases whose model
    generates (`with_generate`), on every case with --all."""
    from paracheck.domain.tier import needs_generate, needs_training, training_parts, with_generate, with_training

    whole = getattr(args, "all", False)
    everything = whole or args.variants is not None
    steps = getattr(args, "steps", DEFAULT_STEPS)
    if steps < 0:
        from paracheck.cli.common import UsageError

        raise UsageError(f"--steps {steps}: a number of optimizer steps, 0 or more")
    checkpoint = not getattr(args, "no_checkpoint", False)
    # Naming the variants asks for those inputs everywhere, not for training everywhere: that is --all's.
    trained = with_training(cases if everything else _quick(args, cases), steps, checkpoint, whole,
                            needs=needs_training, runs=runs, parts=training_parts)
    return with_generate(trained, whole, needs=needs_generate, runs=runs, generates=generates)


def _quick(args, cases: list) -> list:
    from paracheck.domain.tier import quick
    from paracheck.results import known

    entries = known.load(known.SHIPPED if args.known_failures is None else args.known_failures)

    def meets(entry, case) -> bool:  # a case that will be a skip meets no known failure either
        return runs(case) and entry.may_meet(case, registry.adapter(case.library).class_name(case))

    # Each entry once: a case that declares an entry another case already shows says nothing new, and is left to
    # --all (Helios's uneven cases re-declared the ring and Ulysses "anything" backward every model declares).
    extras = [(str(i), _alone(e, entries, cases, meets)) for i, e in enumerate(entries)]
    return quick(cases, extras, runs=runs)


def _alone(entry, entries: list, cases: list, meets):
    """Where the matrix has one, a case the report would declare under `entry`: of the entries naming one check
    that a case meets, the file's last is the one named (`known.apply`), so for one of `entry`'s checks no later
    entry naming it may meet the case; else any case meeting `entry`."""
    later = entries[entries.index(entry) + 1:]
    named = entry.check_ids or (entry.check,)
    rivals = [[e for e in later if c in (e.check_ids or (e.check,))] for c in named]

    def alone(case) -> bool:
        return meets(entry, case) and any(not any(meets(e, case) for e in each) for each in rivals)

    return alone if any(alone(c) for c in cases if c.control is None) else (lambda case: meets(entry, case))


def runs(case) -> bool:
    """False for a case its adapter knows, before any rank starts, will be a skip (`Adapter.will_run`)."""
    return registry.adapter(case.library).will_run(case)


def generates(case) -> bool:
    """Whether the case's model generates text, so parity.generate can run on it (`Adapter.generates`)."""
    return registry.adapter(case.library).generates(case)
