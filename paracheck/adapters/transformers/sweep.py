"""`paracheck run --models transformers:all`: every model class transformers registers for a task the adapter runs
(`tasks`: causal LM, sequence and token classification, image-text-to-text, seq2seq LM, audio-text) whose config
has a TP plan (its own, its text config's, or an encoder-decoder's halves'), each as a tiny config fitted to the
world by `fitting`, over every layout its plans allow.

A family is a model type and a task, named `llama` (causal LM, as before tasks), `llama-seq-cls`, `llava-image-text`,
`t5gemma-seq2seq`, `qwen2_audio-audio-text`; `transformers:all-seq-cls` selects one task's. Per family (sorted by
task, then name): `fitting.tiny` shrinks the config class's defaults, `fitting.fit` raises what the world's degrees
split, so one checkpoint serves every layout, and `tasks.prepared` gives it the task's label count, padding token,
image sizes or audio clip (or refuses a family whose inputs the kit does not make). A layout whose sizes the rule
refuses is a skip with the rule's sentence, decided here, before any rank starts; so is a family whose config
transformers rejects (`Unfittable`) or whose model cannot be built at all (an optional dependency missing:
`ImportError`). The rest run as `payload` cases (the mixins' kind: each rank loads the checkpoint with and without
`distributed_config`), with the checks and controls of the bundled fixtures.

Splitting and resuming: `--shard I/N` keeps the I-th slice of the case list, a family's cases whole in one
slice (`domain.sharding`); only the families of that slice are built. `--resume REPORT.json` leaves out the cases
an earlier report of the same sweep already holds (every status but `error`), so a stopped sweep goes on
where it stopped; `scripts/support_matrix.py` merges any number of such reports (later ones win).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from paracheck.adapters.transformers import fitting, fixtures, tasks
from paracheck.adapters.transformers.controls import applicable
from paracheck.domain.adapter import Swept
from paracheck.domain.case import Case
from paracheck.domain.records import Failure, FailureKind, RankResult, RankStatus, Route
from paracheck.domain.sharding import parse_shard, shard
from paracheck.results import resume

PREFIX = "transformers:"
#: A sweep case's factory: its checkpoint is the family's, written by the launcher (`case.payload`), and a replay
#: names it `--models transformers:NAME` (`TransformersAdapter.models_option`).
FACTORY = "sweep"
#: Parameters a tiny model may have (the largest fitted family has under 1M); above it a size was missed.
MAX_PARAMETERS = 20_000_000


@dataclass
class Family:
    name: str
    config_class: type
    task: tasks.Task = tasks.CAUSAL_LM
    config: object = None  # the fitted tiny config, None when refused
    refused: str = ""  # why the whole family cannot run (a named skip)
    changes: list = field(default_factory=list)

    @property
    def auto(self) -> str:
        """The auto class that builds the family's model (its task's, or that of the mapping naming its type)."""
        return tasks.auto_class(self.task, tasks.by_suffix(self.name)[0])


def wanted(models: str) -> list[str] | None:
    """`transformers:all` -> None (every family); `transformers:llama,phi-seq-cls,all-image-text` -> those (and
    every family of the task an `all-KEY` names)."""
    names = models[len(PREFIX):]
    return None if names == "all" else [n.strip() for n in names.split(",") if n.strip()]


def families(names: list[str] | None = None) -> list[Family]:
    """Every family with a TP plan (or those named), by task, then name."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    found = []
    for task in tasks.TASKS:
        for model_type in sorted(tasks.classes(task)):
            name = model_type + task.suffix
            if names is not None and name not in names and f"all-{task.key}" not in names:
                continue
            if model_type in CONFIG_MAPPING and planned(CONFIG_MAPPING[model_type], task):
                found.append(Family(name, CONFIG_MAPPING[model_type], task))
    keys = {f"all-{task.key}" for task in tasks.TASKS}
    unknown = sorted(set(names or []) - {f.name for f in found} - keys)
    if unknown:
        raise ValueError(f"--models transformers:{','.join(unknown)}: not a family with a TP plan in the installed "
                         f"transformers (a model type, with -{', -'.join(t.key for t in tasks.TASKS[1:])} for a task "
                         "other than causal LM)")
    return found


def planned(config_class, task: tasks.Task) -> bool:
    """Whether the config class carries a TP plan: on the class (a causal LM's, as the sweep always read it), or,
    for the other tasks, on the text config its defaults nest (a vision-language model's language plans)."""
    if getattr(config_class, "base_model_tp_plan", None):
        return True
    if task is tasks.CAUSAL_LM:
        return False
    try:
        return bool(getattr(config_class().get_text_config(), "base_model_tp_plan", None))
    except Exception:  # a config class whose own defaults its validators reject: `fitted` names it
        return True


def fitted(family: Family, world: int, dtype: str = "fp32") -> Family:
    """The family's tiny config fitted to every layout of `world` ranks its plans allow."""
    from paracheck.adapters.transformers.refused import Refused

    config_class = family.config_class
    try:
        tiny = fitting.tiny(config_class)
        nested = fitting.keeps_sizes_nested(tiny)
        if nested and family.task is tasks.CAUSAL_LM:  # its head reads the text sizes at the top: the text config
            raise fitting.Unfittable(f"{config_class.__name__} keeps its sizes in nested configs ({', '.join(nested)});"
                                     " fit the nested text config's own family instead")
        tasks.refuse(tiny, family.task)  # a family whose inputs the kit cannot make is refused before fitting
        has = {degree: fitting.has_plan(tiny, degree) for degree in ("pp", "ep")}
        need = fitting.Need(tp=world, pp=world if has["pp"] else 1, ep=world if has["ep"] else 1, dp=world,
                            itemsize=fitting.ITEMSIZE[dtype])
        fit = fitting.fit(tiny, need)
        config = tasks.prepared(fit.config, family.task)
    except Refused as exc:  # the case names the family: the reason alone, grouped
        family.refused = exc.why
        return family
    except fitting.Unfittable as exc:
        family.refused = str(exc)
        return family
    family.config, family.changes = config, fit.changes
    return family


def plan(request) -> tuple[list[Case], dict[int, str], list[Family], list[dict]]:
    """The sweep's cases (this shard's, less those a resumed report holds), the indices refused before launch
    with their reasons, the families whose checkpoints the remaining cases need, and the resumed report's entries
    for the cases left out (carried into this run's report, as any resumed run's are). A family or --shard it
    cannot take is a ValueError naming it."""
    from paracheck.adapters.transformers.mixin_cases import plan_layouts

    logging.disable(logging.WARNING)  # tiny configs warn about token ids; the report says what matters
    cases, refused, by_family = [], {}, {}
    world = request.nproc
    for family in (fitted(f, world) for f in families(wanted(PREFIX + request.names))):
        by_family[family.name] = family
        layouts = plan_layouts(family.config, world) if family.config else [None]
        if family.config and request.layouts.strip() != "all":
            layouts = [layout for layout in layouts if layout.name in request.layouts.split(",")]
        for layout in layouts:
            why = family.refused or fitting.refusal(family.config, fitting.Need.of(layout))
            layout = layout or _placeholder_layout(world)
            fields = dict(layout=layout, route=Route.SHARDED_LOAD, variant="base", library="transformers",
                          payload=family.name)
            for control in _names(request, layout):
                if why:
                    refused[len(cases)] = why
                cases.append(Case(family.name, FACTORY, **dict(fields, control=control)))
    logging.disable(logging.NOTSET)
    cases, refused = _turned_on(cases, refused, lambda mine, runs: _training(request, mine, runs))
    cases, refused = _turned_on(cases, refused, lambda mine, runs: _generating(request, mine, runs))
    keep = list(range(len(cases)))
    if request.shard:
        keep = shard(keep, *parse_shard(request.shard), group=lambda i: cases[i].model)
    done = resume.held(request.resume) if request.resume else {}
    entries = [resume.entry_for(cases[i], done) for i in keep]
    carried = [entry for entry in entries if entry is not None]
    keep = [i for i, entry in zip(keep, entries) if entry is None]
    needed = {cases[i].model for i in keep if i not in refused}
    return ([cases[i] for i in keep], {n: refused[i] for n, i in enumerate(keep) if i in refused},
            [by_family[name] for name in sorted(needed)], carried)


def _turned_on(cases: list[Case], refused: dict[int, str], turn) -> tuple[list[Case], dict[int, str]]:
    """A later pass turned on family by family, as the default tier turns it on (`turn(family's cases, runs)`: them,
    some with the pass on; `runs(case)`: not refused before launch), the refusals re-indexed to the cases kept (a
    case matched whatever passes it has on)."""
    from dataclasses import replace

    def bare(case):
        return replace(case, generate=False, steps=0, checkpoint=False)

    why = {bare(c): refused[i] for i, c in enumerate(cases) if i in refused}
    chosen = []
    for family in dict.fromkeys(c.model for c in cases):  # the kinds are covered per family
        chosen += turn([c for c in cases if c.model == family], lambda c: bare(c) not in why)
    return chosen, {i: why[bare(c)] for i, c in enumerate(chosen) if bare(c) in why}


def _generating(request, mine: list[Case], runs) -> list[Case]:
    """parity.generate where the family's task generates: one layout of each kind, every one with --all
    (`domain.tier.with_generate`), a control that only generation shows following it."""
    from paracheck.domain.tier import needs_generate, with_generate

    if not tasks.by_suffix(mine[0].model)[1].generates:
        return mine
    return with_generate(mine, request.everything, needs=needs_generate, runs=runs)


def _training(request, mine: list[Case], runs) -> list[Case]:
    """parity.steps (`request.steps` optimizer steps) and checkpoint.roundtrip, every task's: one layout of each
    kind, every one with --all (`domain.tier.with_training`), a control that only training shows following it; a
    class that cannot train or save says so on its ranks, by name."""
    from paracheck.domain.tier import needs_training, with_training

    if not request.steps and not request.checkpoint:
        return mine
    return with_training(mine, request.steps, request.checkpoint, request.everything, needs=needs_training,
                         runs=runs)


def _names(request, layout) -> list:
    """The cases of one family and layout: the plain one (None), then the controls that apply there; with
    `--only-control`, that control alone (no plain case), as `cases.expand` plans it."""
    if request.only_control:
        return [request.only_control]
    return [None] + (list(applicable(layout)) if request.controls else [])


def _placeholder_layout(world: int):
    from paracheck.adapters.transformers.layout import TfLayout

    return TfLayout(fsdp=world)


def build(family: Family, folder: str):
    """Write the family's seeded checkpoint into `folder/<name>`; returns (status, why) where it cannot be
    built, else None."""
    import torch
    import transformers

    auto = getattr(transformers, family.auto)
    path = os.path.join(folder, family.name)
    try:
        with torch.device("meta"):  # counted without memory first: a config the tiny rule missed is refused
            count = sum(p.numel() for p in auto.from_config(family.config).parameters())
        if count > MAX_PARAMETERS:
            return RankStatus.ERROR, (f"{family.name}: the fitted tiny config has {count:,} parameters (more "
                                      f"than {MAX_PARAMETERS:,}): a size the tiny rule does not know")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = auto.from_config(family.config, dtype=torch.float32)
            _nonzero_biases(model, zero_weights=family.task is tasks.IMAGE_TEXT)
        fixtures.write(model, path)
    except ImportError as exc:  # an optional dependency the family's modeling code needs: a named skip
        return RankStatus.SKIP, f"{family.name} cannot be built here: {type(exc).__name__}: {exc}".splitlines()[0]
    except Exception as exc:  # the fitted tiny config does not build: the kit's tiny rule, reported as an error
        unbuilt = _defaults_unbuilt(family)
        if unbuilt:  # the class's own defaults fail too: a field they leave unset, which the kit does not invent
            return RankStatus.SKIP, (f"{family.name}: {family.config_class.__name__}'s own defaults do not build "
                                     f"its model ({unbuilt}), so no tiny config of them does").splitlines()[0]
        return RankStatus.ERROR, (f"{family.name}: the fitted tiny config does not build: "
                                  f"{type(exc).__name__}: {exc}").splitlines()[0]
    return None


def _defaults_unbuilt(family: Family) -> str:
    """How the family's model fails to build from its config class's own defaults (on the meta device, so at no
    memory cost), or "" when it builds."""
    import torch
    import transformers

    try:
        with torch.device("meta"):
            getattr(transformers, family.auto).from_config(family.config_class())
    except Exception as exc:  # whatever the library raises is its own refusal, quoted
        return f"{type(exc).__name__}: {exc}"
    return ""


def _nonzero_biases(model, zero_weights: bool = False) -> None:
    """Biases drawn small instead of transformers' zeros: a zero bias hides every bug in how a bias is added
    (tf-rowwise-bias-before-reduce is not detected on zeros). With `zero_weights`, any other weight left zero but
    a norm's too: a zero image projector (gemma3's) hides the image from the text, and the text's first norm then
    meets zeros, where its gradient is rounding noise times 1/sqrt(eps)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            drawn = name.endswith(".bias") or (zero_weights and "norm" not in name)
            if drawn and not param.any():
                param.normal_(0.0, 0.02)


def prepare(request) -> Swept:
    """Plan, and build the checkpoints of the families the run needs (a line per family), for the host's launch:
    a case whose layout the fitting rule refuses, or whose family did not build, is decided here."""
    from paracheck.adapters.transformers.requirements import missing

    if missing():  # every family loads with from_pretrained: one line, before anything is built
        raise ValueError(missing())
    cases, refused, needed, carried = plan(request)
    folder = tempfile.mkdtemp(prefix="paracheck-sweep-")
    try:
        for n, family in enumerate(needed, 1):
            t0 = time.time()
            failed = build(family, folder)
            _say(f"[family {n}/{len(needed)}] {family.name}: " + (f"{failed[0].value}: {failed[1]}" if failed else
                 f"built in {time.time() - t0:.1f}s ({', '.join(family.changes) or 'no size changed'})"))
            for i, case in enumerate(cases):
                if case.model == family.name:
                    if failed and i not in refused:
                        refused[i] = failed
                    cases[i] = _with_payload(case, os.path.join(folder, family.name))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    meta = {"sweep": {"models": PREFIX + request.names, "shard": request.shard, "families": len(needed)}}
    return Swept(cases, {i: _refusal(i, why) for i, why in refused.items()}, meta,
                 f", {len(needed)} families built", lambda: shutil.rmtree(folder, ignore_errors=True), carried)


def _with_payload(case: Case, path: str) -> Case:
    import dataclasses

    return dataclasses.replace(case, payload=path)


def _refusal(index: int, decided) -> list[RankResult]:
    """A case decided before launch: one skip result in the rule's words (or an error: the family did not build)."""
    status, reason = decided if isinstance(decided, tuple) else (RankStatus.SKIP, decided)
    kind = FailureKind.SKIP if status == RankStatus.SKIP else FailureKind.RAISE
    return [RankResult(index, 0, status, reason=reason, route=Route.SHARDED_LOAD, failure=Failure(kind))]


def _say(line: str) -> None:
    print(line, flush=True)
