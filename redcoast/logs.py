"""Where a run's messages and metrics go: console, ``log.txt``, ``metrics.jsonl``, TensorBoard, W&B.

Only process 0 writes; the other processes stay silent so a multi-host log reads like one.
TensorBoard groups the metrics by their prefix (``train/loss``, ``eval/loss``); ``metrics.jsonl``
keeps the names as logged (``train_loss``, ``eval_loss``). A resume :meth:`RunLogger.rewind` s
both to its step, so every step is recorded once.
"""

import contextlib
import json
import logging as _logging
import os
import sys
import time

import jax
import numpy as np


class RunLogger:
    """Logs text and scalar metrics of one run, from process 0 only."""

    def __init__(self, workdir=None, verbose=True, run_tensorboard=False, wandb_init_kwargs=None):
        self.workdir = workdir
        self.verbose = verbose
        self.enabled = jax.process_index() == 0
        self._tb = None
        self._wandb = None
        self._metrics_file = None
        self._listeners = []  # called with every metrics record, on every process
        self._logger = _logging.getLogger(f"redcoast.run.{id(self)}")
        self._logger.setLevel(_logging.INFO)
        self._logger.propagate = False
        if not self.enabled:
            return
        fmt = _logging.Formatter("[%(asctime)s redcoast] %(message)s", "%H:%M:%S")
        if verbose:
            console = _logging.StreamHandler(sys.stdout)
            console.setFormatter(fmt)
            self._logger.addHandler(console)
        if workdir is not None:
            os.makedirs(workdir, exist_ok=True)
            file_handler = _logging.FileHandler(os.path.join(workdir, "log.txt"))
            file_handler.setFormatter(fmt)
            self._logger.addHandler(file_handler)
            # Appended to, so a continued run keeps its history; a marker line starts each run.
            self._metrics_file = open(os.path.join(workdir, "metrics.jsonl"), "a")
            self._metrics_file.write(json.dumps({"event": "run_start", "time": time.time()}) + "\n")
            self._metrics_file.flush()
        if not self._logger.handlers:  # quiet, no workdir: not Python's last-resort handler,
            self._logger.addHandler(_logging.NullHandler())  # which would print warnings twice
        if run_tensorboard:
            if workdir is None:
                raise ValueError("run_tensorboard=True needs a workdir to write events to. "
                                 "Fix: pass workdir=... to Deployer.")
            from .store.tensorboard_events import ScalarWriter  # synchronous: flushed scalars are on disk
            self._tb = ScalarWriter(os.path.join(workdir, "tensorboard"))
        if wandb_init_kwargs is not None:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("wandb_init_kwargs was given but wandb is not installed. "
                                  "Fix: pip install 'redcoast[wandb]'.") from e
            self._wandb = wandb.init(**wandb_init_kwargs)

    def info(self, text, title=None):
        if not self.enabled:
            return
        if title is not None:
            text = f"{title}\n{text}"
        for line in str(text).splitlines() or [""]:
            self._logger.info(line)

    def warning(self, text):
        if not self.enabled:
            return
        self._logger.warning(f"WARNING: {text}")
        if not self.verbose:  # a warning changes what the run does: said even when quiet
            print(f"[redcoast] WARNING: {text}", file=sys.stderr, flush=True)

    def metrics(self, metrics, step):
        """Record a dict of scalars at ``step`` in every enabled sink (and report it to the
        listeners of :meth:`reporting_to`, on every process)."""
        scalars = {k: _to_python(v) for k, v in metrics.items()}
        for listener in self._listeners:
            listener(scalars, int(step))
        if not self.enabled:
            return
        if self._metrics_file is not None:
            self._metrics_file.write(json.dumps({"step": int(step), "time": time.time(), **scalars}) + "\n")
            self._metrics_file.flush()
        if self._tb is not None:
            for k, v in scalars.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(tensorboard_tag(k), v, global_step=int(step))
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=int(step))

    @contextlib.contextmanager
    def reporting_to(self, listener):
        """Within the block, ``listener(scalars, step)`` gets every metrics record (``fit``'s
        History)."""
        self._listeners.append(listener)
        try:
            yield
        finally:
            self._listeners.remove(listener)

    def rewind(self, step):
        """Forget the metrics recorded after ``step`` (a resume from a checkpoint at ``step``
        trains and logs those steps again): ``metrics.jsonl`` rewritten without them (its other
        lines as they were), TensorBoard told to purge them. Returns how many records went."""
        if not self.enabled:
            return 0
        dropped = 0
        if self._metrics_file is not None:
            path = self._metrics_file.name
            self._metrics_file.close()
            kept = []
            with open(path) as f:
                for line in f:
                    if _step_of(line) > step:
                        dropped += 1
                    else:
                        kept.append(line)
            if dropped:
                with open(path + ".tmp", "w") as f:
                    f.writelines(kept)
                os.replace(path + ".tmp", path)
            self._metrics_file = open(path, "a")
        if self._tb is not None:
            self._tb.purge(step + 1)
        return dropped

    def close(self):
        for handler in list(self._logger.handlers):
            handler.close()
            self._logger.removeHandler(handler)
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def tensorboard_tag(name):
    """``train_loss`` -> ``train/loss``, ``eval_accuracy`` -> ``eval/accuracy`` (TensorBoard
    groups by the part before the slash); other names as they are."""
    prefix, _, rest = name.partition("_")
    return f"{prefix}/{rest}" if prefix in ("train", "eval") and rest else name


def _step_of(line):
    """The step of one ``metrics.jsonl`` line (-1 for an event, or a line that is not a
    record: kept as it is)."""
    try:
        record = json.loads(line)
    except ValueError:
        return -1
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else -1


def _to_python(value):
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    array = np.asarray(value)
    if array.ndim == 0:
        return array.item()
    return array.tolist()
