"""Training checkpoints: sharded, asynchronous, atomic, restorable onto another mesh (Orbax).

A checkpoint holds the training state's arrays (step, parameters, optimizer state) written by
every process for its own shards, and a JSON record of where the run was (epoch, position in
the epoch, random keys, best metrics so far, the run's configuration). Orbax writes a step into
a temporary directory and renames it when complete, so a crash at any moment leaves the previous
complete checkpoint intact; a damaged one is reported and skipped. Nothing is pickled.
"""

import os

import numpy as np
import orbax.checkpoint as ocp

from .errors import ConfigError
from .sharding.paths import leaves_with_paths, path_to_str


class CheckpointStore:
    """The checkpoints of one run kept in ``directory`` (one sub-directory per step)."""

    def __init__(self, directory, keep_last_n=None, async_save=True, logger=None):
        self.directory = os.path.abspath(directory)
        self.logger = logger
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep_last_n, enable_async_checkpointing=async_save, create=True,
            cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})
        self._last_saved = None

    def steps(self):
        return sorted(self._manager.all_steps())

    def save(self, step, state_arrays, meta):
        """Start writing a checkpoint; returns once the arrays are copied off the devices."""
        if step == self._last_saved or step in self._manager.all_steps():
            return  # this exact state is already saved (or being saved)
        self._last_saved = step
        self._manager.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(state_arrays), meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self):
        """Block until every started save is complete on disk."""
        self._manager.wait_until_finished()

    def restore_latest(self, abstract_state):
        """``(state, meta)`` from the newest complete checkpoint that reads back, or None.

        ``abstract_state`` gives the structure, shapes, dtypes and target shardings (the current
        mesh, which may differ from the one that saved). A checkpoint of a different model is an
        error naming the differences; a damaged one is skipped with a warning.
        """
        for step in reversed(self.steps()):
            where = os.path.join(self.directory, str(step))
            try:
                saved = self._manager.item_metadata(step)["state"]
                saved_tree = saved.tree if hasattr(saved, "tree") else saved
                if saved_tree is None:
                    raise ValueError("no array metadata")
            except Exception as e:  # unreadable metadata: a damaged checkpoint
                self._warn(f"checkpoint {where} is damaged ({type(e).__name__}: {e}); skipping it.")
                continue
            check_same_model(saved_tree, abstract_state, where)
            try:
                restored = self._manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
            except Exception as e:
                self._warn(f"checkpoint {where} is damaged ({type(e).__name__}: {e}); skipping it.")
                continue
            return restored["state"], restored["meta"]
        return None

    def close(self):
        self._manager.wait_until_finished()
        self._manager.close()

    def _warn(self, text):
        if self.logger is not None:
            self.logger.warning(text)
        else:
            print(f"WARNING: {text}")


def check_same_model(saved_tree, abstract_state, where):
    """Raise a clear error if the saved arrays are not those of ``abstract_state``."""
    def shapes(tree):
        return {path_to_str(p): tuple(getattr(leaf, "shape", ()))
                for p, leaf in leaves_with_paths(tree)}

    saved, expected = shapes(saved_tree), shapes(abstract_state)
    params_first = lambda k: (not k.startswith("params"), k)  # the model before its optimizer
    missing = sorted(set(expected) - set(saved), key=params_first)
    unexpected = sorted(set(saved) - set(expected), key=params_first)
    different = sorted((k for k in set(saved) & set(expected) if saved[k] != expected[k]),
                       key=params_first)
    if not (missing or unexpected or different):
        return
    lines = [f"in the model, not the checkpoint: {k} {expected[k]}" for k in missing[:8]]
    lines += [f"in the checkpoint, not the model: {k} {saved[k]}" for k in unexpected[:8]]
    lines += [f"shape of {k}: {saved[k]} saved, {expected[k]} in the model" for k in different[:8]]
    raise ConfigError(
        f"The checkpoint {where} holds another model (or optimizer):\n  " + "\n  ".join(lines) +
        "\nFix: use the model and optimizer it was saved with, another workdir, or "
        "resume=False to start afresh.")


def key_to_json(key):
    """A raw PRNG key (uint32 array) as a JSON-able list; :func:`key_from_json` reverses it."""
    return np.asarray(key).tolist()


def key_from_json(data):
    return np.asarray(data, dtype=np.uint32)
