"""A run's record is the run: ``redcoast train`` resumes only under the record its checkpoint
was written under, unless told, and keeps every record a run ran under.

A resume (``fit.resume``, a checkpoint in ``<workdir>/checkpoints/steps``) compares the new
record with the one stored in the newest checkpoint (``files/run.yaml``) and, where they differ,
stops before any training with every changed field, ``old -> new``. With ``--allow-changes`` (or
``resume: {allow_changes: true}`` in the file) it logs each change and continues under the new
record. Either way nothing is overwritten silently:

    <workdir>/run.yaml                  the record the run runs under now (the latest)
    <workdir>/run-history/step-0.yaml   every record the run ran under, named by the update it
    <workdir>/run-history/step-120.yaml   started at (one per change; ``~1`` where a name is taken)

A run started afresh in a workdir holding an earlier run's records moves them aside (to
``run-history.earlier-run-<UTC time>/``), as ``fit`` moves the earlier checkpoints.

Fields that count: every one, except those that cannot change the numbers a run trains to
(:data:`UNCOUNTED`): where messages and metrics go (``deployer.verbose``, ``run_tensorboard``,
``wandb_init_kwargs``, ``fit.log_every_n_steps``), where the run and its result live
(``deployer.workdir``: a workdir moved or copied is the same run; ``export`` and
``lora.save``, which say only what is written at the end), the addresses of
a multi-host run (``deployer.process_id``, ``host0_address``, ``host0_port``: they differ per
process and after a restart on other machines), and the switches of the resume itself
(``fit.resume``, ``resume.allow_changes``). Changes to those are logged and kept in the history,
never refused. Checkpoint and evaluation settings count (the safe default), though they do not
change the parameters: ``--allow-changes`` lets them through.
"""

import dataclasses
import time

from etils import epath

from ..errors import ConfigError

RECORD = "run.yaml"  # the run's record, in the workdir and in every checkpoint's files/
HISTORY = "run-history"
WHOLE = "(the record)"  # a change of the whole record: none stored, or one not readable
UNCOUNTED = frozenset({
    "deployer.verbose", "deployer.run_tensorboard", "deployer.wandb_init_kwargs",
    "fit.log_every_n_steps", "deployer.workdir", "export", "lora.save", "deployer.process_id",
    "deployer.host0_address", "deployer.host0_port", "fit.resume", "resume.allow_changes"})


@dataclasses.dataclass(frozen=True)
class Change:
    path: str  # the field's YAML path, e.g. optimizer.learning_rate
    old: object
    new: object

    @property
    def counts(self) -> bool:
        return self.path not in UNCOUNTED

    def __str__(self) -> str:
        if self.path == WHOLE:  # no record to compare field by field
            return f"{WHOLE}: {self.old}"
        return f"{self.path}: {_as_yaml(self.old)} -> {_as_yaml(self.new)}"


@dataclasses.dataclass(frozen=True)
class Resume:
    """The newest checkpoint of a workdir: its ``step``, the record stored with it (``text``;
    None where it holds none) and how the new record differs from it (``changes``)."""

    step: int
    text: object
    changes: tuple

    @property
    def counted(self) -> list:
        return [c for c in self.changes if c.counts]


def newest_checkpoint(workdir):
    """``(step, its record's text or None)`` of the newest checkpoint in ``workdir``, or None."""
    steps = epath.Path(workdir) / "checkpoints" / "steps"
    if not steps.is_dir():
        return None
    done = [int(p.name) for p in steps.iterdir() if p.name.isdigit()]  # Orbax's tmp dirs: not
    if not done:
        return None
    step = max(done)
    record = steps / str(step) / "files" / RECORD
    return step, (record.read_text() if record.exists() else None)


def changes(old: dict, new: dict, prefix: str = "") -> list:
    """Every field whose value differs between two records' dicts (RunConfig.to_dict)."""
    out = []
    for key in list(old) + [k for k in new if k not in old]:
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changes(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(Change(f"{prefix}{key}", a, b))
    return out


def check_resume(cfg) -> object:
    """The :class:`Resume` ``cfg`` (a RunConfig, paths absolute) continues, or None where it
    starts afresh; a :class:`ConfigError` listing each change when fields that count differ from
    the stored record and ``cfg.resume.allow_changes`` is not set. Reads, writes nothing."""
    from .run_config import RunConfig

    newest = newest_checkpoint(cfg.deployer.workdir) if cfg.fit.resume else None
    if newest is None:
        return None
    step, text = newest
    where = f"{cfg.deployer.workdir}/checkpoints/steps/{step}"
    if text is None:
        found = [Change(WHOLE, f"none stored with {where} (saved by Trainer.fit?), so nothing "
                               "shows that this record is that run's", None)]
    else:
        try:
            old = RunConfig.from_yaml(text, f"{where}/files/{RECORD}").to_dict()
        except ConfigError as e:  # a record of another redcoast version, say
            found = [Change(WHOLE, f"the stored one is not readable: {e}", None)]
        else:
            found = changes(old, cfg.to_dict())
    resume = Resume(step, text, tuple(found))
    if resume.counted and not cfg.resume.allow_changes:
        lines = "\n  ".join(map(str, resume.counted))
        raise ConfigError(
            f"the workdir holds a run at step {step} ({where}) recorded with other settings; "
            f"resuming it under this record would continue it as another run:\n  {lines}\n"
            f"Fix: resume with the stored record (redcoast train {where}/files/{RECORD}, or "
            "restore the values on the left), or continue under the new values with "
            "--allow-changes (or `resume: {allow_changes: true}`): each change is logged and both "
            f"records are kept in {HISTORY}/; or start afresh with --fit.resume=false (the "
            "checkpoints are moved aside, not deleted) or another deployer.workdir.")
    return resume


def keep(workdir, text: str, resume, log_info, log_warning) -> None:
    """Write ``text`` as ``<workdir>/run.yaml`` and keep the history (see the module's docstring):
    ``resume`` is :func:`check_resume`'s answer. Process 0 alone calls this."""
    workdir = epath.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    current, history = workdir / RECORD, workdir / HISTORY
    if resume is None:
        _aside_earlier_run(workdir, text, log_info)
        _keep_in(history, "step-0.yaml", text)
    else:
        for change in resume.changes:
            (log_warning if change.counts else log_info)(
                f"resumed at step {resume.step} with {change}"
                + ("" if change.counts else " (does not change the run's numbers)"))
        if resume.changes:
            if resume.text is not None and not _held(history, resume.text):
                # a run started before the history was kept: where it began is unknown
                _keep_in(history, f"until-step-{resume.step}.yaml", resume.text)
            name = _keep_in(history, f"step-{resume.step}.yaml", text)
            log_info(f"the run continues under the new record from step {resume.step}: "
                     f"{current} (and {name}); the records before: {history}/")
        old = current.read_text() if current.exists() else text
        if old != text and not _held(history, old):  # an attempt that saved nothing: kept too
            _keep_in(history, f"replaced-{_now()}.yaml", old)
    current.write_text(text)


def _aside_earlier_run(workdir, text, log_info):
    """Move an earlier run's history (and a run.yaml it lacks) aside, unless it is this run's
    start already (a rerun of a run that saved no checkpoint, under the same record)."""
    current, history = workdir / RECORD, workdir / HISTORY
    entries = sorted(history.iterdir()) if history.is_dir() else []
    old = current.read_text() if current.exists() else None
    same = old in (None, text) and all(p.name == "step-0.yaml" and p.read_text() == text
                                       for p in entries)
    if same or (not entries and old is None):
        return
    aside = workdir / f"{HISTORY}.earlier-run-{_now()}"
    n = 1
    while aside.exists():
        aside = workdir / f"{HISTORY}.earlier-run-{_now()}~{n}"
        n += 1
    if entries:
        history.rename(aside)
    if old is not None and old != text and not _held(aside, old):
        _keep_in(aside, RECORD, old)
    log_info(f"this run starts afresh: the records of an earlier run in this workdir were moved "
             f"to {aside}/")


def _held(folder, text) -> bool:
    return folder.is_dir() and any(p.read_text() == text for p in folder.iterdir())


def _keep_in(folder, name, text) -> str:
    """Write ``text`` as ``folder/name`` (``name~1``, ... where another text has that name);
    the path written (or that already held it)."""
    folder.mkdir(parents=True, exist_ok=True)
    stem, ext = name.rsplit(".", 1)
    path, n = folder / name, 1
    while path.exists() and path.read_text() != text:
        path, n = folder / f"{stem}~{n}.{ext}", n + 1
    if not path.exists():
        path.write_text(text)
    return str(path)


def _now() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def _as_yaml(value) -> str:
    return "null" if value is None else repr(value) if isinstance(value, str) else str(value)
