"""Training checkpoints: sharded, asynchronous, atomic, restorable onto another mesh (Orbax).

A checkpoint holds the training state's arrays (step, parameters, optimizer state) written by
every process for its own shards, and a JSON record of where the run was (epoch, position in
the epoch, random keys, best metrics so far, the run's configuration). Orbax writes a step into
a temporary directory and renames it when complete, so a crash at any moment leaves the previous
complete checkpoint intact; a damaged one is reported and skipped (and moved aside if a later
save needs its step number). Arrays are stored as nested dicts keyed by their path strings, so
any pytree (Flax dicts, optax tuples, ``nnx.Module``s with mixed int/str keys) saves and restores.
Nothing is pickled. ``directory`` may be a URL Orbax supports (``gs://...``). A store given
``files`` writes them, as they are, into every checkpoint's ``files/`` folder (the run's YAML,
for ``redcoast train``): with the checkpoint, in its atomic rename.
"""

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
# not exported by Orbax; tests/test_checkpoint.py checks that saves still write what its
# default handler writes
from orbax.checkpoint._src.metadata import array_metadata_store

from ..errors import CheckpointError, ConfigError
from ..sharding.paths import leaves_with_paths, path_to_str
from .workdir import absolute, join, move_aside


class CheckpointStore:
    """The checkpoints of one run kept in ``directory`` (one sub-directory per step)."""

    def __init__(self, directory, keep_last_n=None, async_save=True, logger=None,
                 replace_existing=False, files=None, replica_slice_min_bytes=None):
        check_keep_last_n(keep_last_n)
        self.files = dict(files or {})  # {file name: text} written with every checkpoint
        self.directory = absolute(directory)
        self.logger = logger
        # a best-so-far store: the same step saved by an interrupted attempt of this run is replaced
        self.replace_existing = replace_existing
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep_last_n, enable_async_checkpointing=async_save, create=True,
            cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": state_handler(replica_slice_min_bytes),
                           "meta": ocp.JsonCheckpointHandler(),
                           FILES: TextFilesHandler()})
        self._last_saved = None  # the step this store wrote or restored: that state is on disk
        self._damaged = {}  # step -> why it did not restore

    def steps(self):
        return sorted(self._manager.all_steps())

    def save(self, step, state_arrays, meta):
        """Start writing a checkpoint; returns once the arrays are copied off the devices.

        Saving the step this store last wrote or restored again is skipped (the same state is on
        disk). A step on disk that this store did not write is never silently kept in place of
        the new state: a damaged one is moved aside, any other is an error.
        """
        if step == self._last_saved:
            return
        if step in self._manager.all_steps():
            where = join(self.directory, str(step))
            if self.replace_existing and step not in self._damaged:
                self._manager.delete(step)
            elif step not in self._damaged:
                raise CheckpointError(
                    f"Cannot save step {step}: {where} already holds a checkpoint that this run "
                    "did not write (another run's?). Fix: use another workdir, or resume=True to "
                    "continue that run.")
            else:
                aside = move_aside(where, "damaged", self.logger)
                self._warn(f"moved the damaged checkpoint {where} aside to {aside} to save step "
                           f"{step}.")
                self._manager.reload()
        self._last_saved = step
        items = {"state": ocp.args.PyTreeSave(to_saved(state_arrays)),
                 "meta": ocp.args.JsonSave(meta)}
        if self.files:
            items[FILES] = TextFilesSave(self.files)
        self._manager.save(int(step), args=ocp.args.Composite(**items), force=True)

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
            where = join(self.directory, str(step))
            try:
                saved = self._manager.item_metadata(step)["state"]
                saved_tree = saved.tree if hasattr(saved, "tree") else saved
                if saved_tree is None:
                    raise ValueError("no array metadata")
            except Exception as e:  # unreadable metadata: a damaged checkpoint
                self._skip(step, where, f"is damaged ({type(e).__name__}: {e})")
                continue
            check_same_model(saved_tree, abstract_state, where)
            try:
                target = to_saved(abstract_state)
                restored = self._manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        target, ocp.checkpoint_utils.construct_restore_args(target)),
                    meta=ocp.args.JsonRestore()))
            except Exception as e:  # same arrays by name and shape, yet unreadable: damaged data
                self._skip(step, where, f"could not be read although it holds this model's "
                                        f"arrays: damaged? ({type(e).__name__}: {e})")
                continue
            self._last_saved = step
            return from_saved(restored["state"], abstract_state), restored["meta"]
        return None

    def latest_meta(self):
        """The JSON record of the newest checkpoint that has a readable one (no arrays read),
        or None."""
        for step in reversed(self.steps()):
            try:
                return self._manager.restore(step, args=ocp.args.Composite(
                    meta=ocp.args.JsonRestore()))["meta"]
            except Exception:  # noqa: BLE001 - a damaged record: the one before it
                continue
        return None

    def restore_latest_or_fail(self, abstract_state):
        """As :meth:`restore_latest`, but checkpoints that exist and none restores are an error
        (training from scratch would silently drop the run they hold); None if there are none."""
        restored = self.restore_latest(abstract_state)
        if restored is None and self._damaged:
            lines = "\n  ".join(f"{join(self.directory, str(s))}: {why}"
                                for s, why in sorted(self._damaged.items()))
            raise CheckpointError(
                f"None of the {len(self._damaged)} checkpoint(s) in {self.directory} restores:\n  "
                f"{lines}\nFix: resume=False to start afresh (the old checkpoints are then moved "
                "aside, not deleted), or another workdir.")
        return restored

    def close(self):
        self._manager.wait_until_finished()
        self._manager.close()

    def _skip(self, step, where, why):
        self._damaged[step] = why
        self._warn(f"checkpoint {where} {why}; skipping it.")

    def _warn(self, text):
        if self.logger is not None:
            self.logger.warning(text)
        else:
            print(f"WARNING: {text}")


# Orbax writes an array that several devices hold in slices, one per holder ("replica-parallel"):
# for a small array that costs more than it saves (one eager slice per holder before any byte is
# written). A tiny model's 21 saves took 17.6 s of a 32 s run here, 10.8 s of it slicing
# (tests/ckpt_worker.py: 27.4 -> 14.6 s a run without it; benchmarks/checkpoint_replicas.py
# measures both at 100M parameters). Slices of at least this many bytes are still written in
# parallel.
REPLICA_SLICE_MIN_BYTES = 4 << 20


def state_handler(replica_slice_min_bytes=None):
    """Orbax's handler for pytrees of arrays, writing in replica slices only slices of at least
    ``replica_slice_min_bytes`` (default :data:`REPLICA_SLICE_MIN_BYTES`; 0: Orbax's default,
    every replicated array). Orbax's default handlers for every other type (those registered
    with Orbax's global registry, a user's included)."""
    if replica_slice_min_bytes is None:
        replica_slice_min_bytes = REPLICA_SLICE_MIN_BYTES
    arrays = ocp.type_handlers.ArrayHandler(
        min_slice_bytes_for_replica_parallel=replica_slice_min_bytes,
        # what Orbax's default jax.Array handler writes next to the arrays (array_metadatas/)
        array_metadata_store=array_metadata_store.Store())
    registry = ocp.type_handlers.create_type_handler_registry(
        *((kind, arrays if kind is jax.Array else ocp.type_handlers.get_type_handler(kind))
          for kind in ocp.type_handlers.supported_types()))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


FILES = "files"  # the item (folder) of a checkpoint that holds the store's files


class TextFilesHandler(ocp.JsonCheckpointHandler):
    """Writes ``{name: text}`` as files named ``name`` in the item's folder (on the primary host,
    as Orbax's JSON handler writes its record), asynchronously with the rest of the checkpoint."""

    async def _save_fn(self, x, directory):
        if ocp.utils.is_primary_host(self._primary_host):
            for name, text in x.items():
                (directory / name).write_text(text)

    def restore(self, directory, item=None, args=None):
        return {path.name: path.read_text() for path in directory.iterdir()}


@ocp.args.register_with_handler(TextFilesHandler, for_save=True)
@dataclasses.dataclass
class TextFilesSave(ocp.args.CheckpointArgs):
    item: Mapping[str, str]


@ocp.args.register_with_handler(TextFilesHandler, for_restore=True)  # Orbax wants both
@dataclasses.dataclass
class TextFilesRestore(ocp.args.CheckpointArgs):
    item: None = None


def check_keep_last_n(keep_last_n):
    """``keep_last_n`` must keep at least one checkpoint (0 would delete every one, the
    preemption save included)."""
    if keep_last_n is None:
        return
    if isinstance(keep_last_n, bool) or not isinstance(keep_last_n, (int, np.integer)) or keep_last_n < 1:
        raise ConfigError(
            f"keep_last_n_ckpts={keep_last_n!r} would keep no checkpoint (each save would delete "
            "the one before, the preemption save included). Fix: a positive integer, or None to "
            "keep them all.")


def to_saved(tree):
    """The arrays of ``tree`` as nested dicts keyed by path strings (what Orbax stores)."""
    out = {}
    for path, leaf in leaves_with_paths(tree):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"Two leaves of the training state share the path "
                                  f"{path_to_str(path)}; it cannot be checkpointed. Fix: give "
                                  "the parameters distinct names.")
        node[path[-1]] = leaf
    return out


def from_saved(saved, like):
    """Rebuild the structure of ``like`` from :func:`to_saved`'s nested dicts."""
    def lookup(path):
        node = saved
        for key in path:
            node = node[key]
        return node

    flat, treedef = jax.tree_util.tree_flatten(like)
    paths = [p for p, _ in leaves_with_paths(like)]
    return jax.tree_util.tree_unflatten(treedef, [lookup(p) for p in paths])


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
