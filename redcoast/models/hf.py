"""Hugging Face folders: config.json plus safetensors weights, read slice by slice and written back.

Each parameter is placed with ``jax.make_array_from_callback``: every device asks for its own slice
and only that slice is read from the file (safetensors maps the file; a slice read touches only
its bytes), so the whole model is never materialised on one device. A tensor stored transposed
relative to redcoast's layout (PyTorch's ``nn.Linear`` keeps (out, in)) is read by transposing the
slice request, not the tensor.
"""

import dataclasses
import json
import math
import os
from dataclasses import dataclass

import jax
import numpy as np

from ..errors import ConfigError
from ..store.folder_files import file_in_folder, read_json_object
from ..store.safetensors_check import open_safetensors, wrapped
from ..store.tensor_files import entry, write_safetensors
from .folder_index import REFETCH, read_weight_map, weight_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def local_folder(path):
    """``path`` as an existing local folder, or a clear error (nothing is downloaded)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    looks_like_hub_name = path.count("/") == 1 and not os.path.exists(os.path.dirname(path) or ".")
    hint = (f" '{path}' looks like a model hub name; redcoast reads weights from disk only and never "
            "downloads at run time. Download it elsewhere (e.g. `hf download "
            f"{path} --local-dir DIR`) and pass DIR." if looks_like_hub_name or "/" in path else "")
    raise ConfigError(f"'{path}' is not a local folder.{hint}")


def read_config(folder):
    """The folder's config.json as a dict."""
    path = file_in_folder(local_folder(folder), "config.json", "the model's config")
    if not os.path.exists(path):
        raise ConfigError(f"{folder} has no config.json; a Hugging Face model folder needs one.")
    return read_json_object(path, REFETCH)


class SafetensorsFolder:
    """The tensors of one folder: ``model.safetensors`` or a sharded index of several files."""

    def __init__(self, folder):
        self.folder = local_folder(folder)
        index = file_in_folder(self.folder, INDEX_FILE, "the weights' index")
        if os.path.exists(index):
            weight_map = read_weight_map(index)
            first_tensor = {}
            for tensor, name in weight_map.items():
                first_tensor.setdefault(name, tensor)
            paths = {name: weight_file(self.folder, name, f"{index}'s entry for tensor {tensor!r}")
                     for name, tensor in first_tensor.items()}
        elif os.path.exists(os.path.join(self.folder, SINGLE_FILE)):
            weight_map = None
            paths = {SINGLE_FILE: weight_file(self.folder, SINGLE_FILE, "the model's weights")}
        else:
            raise ConfigError(f"{self.folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; redcoast "
                              "reads safetensors weights only (convert .bin files with "
                              "transformers' save_pretrained(safe_serialization=True)).")
        self._handles = {name: open_safetensors(path, REFETCH) for name, path in paths.items()}
        self._paths = paths
        if weight_map is None:
            weight_map = {key: SINGLE_FILE for key in self._handles[SINGLE_FILE].keys()}
        else:
            _check_listed_tensors(index, weight_map, self._handles, paths)
        self._file_of = weight_map

    def names(self):
        return list(self._file_of)

    def __contains__(self, name):
        return name in self._file_of

    def _slice(self, name):
        if name not in self._file_of:
            raise ConfigError(f"tensor {name!r} is missing from {self.folder}")
        return self._handles[self._file_of[name]].get_slice(name)

    def shape(self, name):
        return tuple(self._slice(name).get_shape())

    def read(self, name, index=None):
        """The tensor (or ``index``, a tuple of slices, of it) as a numpy array."""
        sl = self._slice(name)
        if index is None:
            index = tuple(slice(None) for _ in sl.get_shape())
        return wrapped(self._paths[self._file_of[name]], REFETCH, f"read (tensor {name!r})",
                       lambda: np.asarray(sl[tuple(index)]))


def _check_listed_tensors(index, weight_map, handles, paths):
    """Every tensor the index lists lies in the file it names there."""
    held = {name: set(handle.keys()) for name, handle in handles.items()}
    missing = [(tensor, name) for tensor, name in weight_map.items() if tensor not in held[name]]
    if missing:
        tensor, name = missing[0]
        raise ConfigError(f"{index} places tensor {tensor!r} in {paths[name]}, which does not "
                          f"hold it ({len(missing)} such tensors). Fix: {REFETCH}.")


class TensorDict:
    """A reader over in-memory ``{name: array}`` with :class:`SafetensorsFolder`'s interface
    (``shape(name)``, ``read(name, index)``), for weights that come from elsewhere; pass it to
    :func:`redcoast.models.pretrained.from_reader`."""

    def __init__(self, tensors):
        self.tensors = tensors

    def __contains__(self, name):  # aliases and config_for_tensors ask (BERT, BART, T5, ViT)
        return name in self.tensors

    def shape(self, name):
        if name not in self.tensors:
            raise ConfigError(f"tensor {name!r} is missing from the given tensors")
        return tuple(np.shape(self.tensors[name]))

    def read(self, name, index=None):
        array = self.tensors[name]
        return np.asarray(array if index is None else array[tuple(index)])


@dataclass(frozen=True)
class Source:
    """Where one parameter comes from: a stored tensor, possibly transposed (2-D only).

    ``aliases`` are other names the same tensor is stored under in some folders (e.g. BERT's
    "bert." prefix); the first name present is read, ``name`` is the one written. ``shape`` is
    the stored shape when the parameter is the stored tensor reshaped (row-major), e.g. GPT-2's
    fused (hidden, 3*hidden) Q/K/V kept as (hidden, 3, hidden) so that heads can be split."""

    name: str
    transpose: bool = False
    aliases: tuple = ()
    shape: tuple = None


def stored_name(reader, source):
    """The name under which ``reader`` holds ``source`` (``source.name`` when none matches)."""
    for name in (source.name, *source.aliases) if source.aliases else ():
        if name in reader:
            return name
    return source.name


@dataclass(frozen=True)
class Stacked:
    """A parameter holding the same tensor of every layer on a new leading axis (layers run by a
    scan, :mod:`redcoast.models.stacked`): ``layers[i]`` is the :class:`Source` of layer i.
    Folders keep one tensor per layer; each is read into (and written from) its row."""

    layers: tuple


def stack_sources(per_layer):
    """One tree of :class:`Stacked` from a list of per-layer trees of :class:`Source`."""
    return jax.tree_util.tree_map(lambda *layers: Stacked(tuple(layers)), *per_layer,
                                  is_leaf=lambda x: isinstance(x, Source))


def is_source(x):
    """Whether ``x`` is a leaf of an ``hf_sources`` tree."""
    return isinstance(x, (Source, Stacked))


def parts(source, shape):
    """``[(Source, shape of the part)]``: the stored tensors behind one parameter of ``shape``."""
    if isinstance(source, Stacked):
        return [(s, tuple(shape[1:])) for s in source.layers]
    return [(source, tuple(shape))]


def stored_shape(source, shape):
    """The shape ``source`` (a :class:`Source`) must have in a folder for a parameter part of
    ``shape``."""
    if source.shape is not None:
        return tuple(source.shape)
    return tuple(reversed(shape)) if source.transpose else tuple(shape)


def load_array(reader, source, shape, sharding, dtype):
    """One parameter as a ``jax.Array`` placed with ``sharding``; each device reads its slice
    (of a :class:`Stacked` parameter, its slice of each of its layers' tensors)."""
    readers = [_slice_reader(reader, part, part_shape, dtype)
               for part, part_shape in parts(source, shape)]
    if isinstance(source, Stacked):
        if len(readers) != shape[0]:
            raise ConfigError(f"{len(readers)} layers' tensors for a stack of {shape[0]}.")

        def slice_for(index):
            rows = range(shape[0])[index[0]]
            return np.stack([readers[i](tuple(index[1:])) for i in rows])
    else:
        slice_for = readers[0]
    return jax.make_array_from_callback(tuple(shape), sharding, slice_for)


def _slice_reader(reader, source, shape, dtype):
    """``index -> array``: the index of the parameter of ``shape`` that ``source`` holds."""
    source = dataclasses.replace(source, name=stored_name(reader, source), aliases=())
    stored = reader.shape(source.name)
    expected = stored_shape(source, shape)
    if stored != expected:
        raise ConfigError(f"tensor {source.name!r} has shape {stored}, the config implies {expected}; "
                          "the folder's config.json does not describe its weights.")

    def slice_for(index):
        if source.shape is not None:
            return _read_reshaped(reader, source.name, stored, tuple(shape), index).astype(dtype)
        if source.transpose:
            return reader.read(source.name, tuple(reversed(index))).T.astype(dtype)
        return reader.read(source.name, index).astype(dtype)

    return slice_for


def _read_reshaped(reader, name, stored, shape, index):
    """``index`` of the stored tensor viewed as ``shape``: only the leading axes the two shapes
    share can be sliced in the file, the rest is read whole, reshaped, then indexed."""
    k = 0
    while k < min(len(stored), len(shape)) and stored[k] == shape[k]:
        k += 1
    block = reader.read(name, tuple(index[:k]) + (slice(None),) * (len(stored) - k))
    block = block.reshape(block.shape[:k] + shape[k:])
    return block[(slice(None),) * k + tuple(index[k:])]


def load_params(reader, sources, abstract_params, shardings=None, dtype=None):
    """Params shaped like ``abstract_params`` filled from ``reader``.

    ``sources`` mirrors ``abstract_params`` with a :class:`Source` (or :class:`Stacked`) per leaf; ``shardings``
    mirrors it with a ``jax.sharding.Sharding`` per leaf (default: the first local device).
    """
    if shardings is None:
        device = jax.local_devices()[0]
        shardings = jax.tree_util.tree_map(
            lambda _: jax.sharding.SingleDeviceSharding(device), abstract_params)
    return jax.tree_util.tree_map(
        lambda src, a, s: load_array(reader, src, a.shape, s, np.dtype(dtype or a.dtype)),
        sources, abstract_params, shardings, is_leaf=is_source)


def save_folder(folder, config, tensors, max_shard_bytes=None):
    """Write ``config`` (dict) and ``tensors`` (name -> array of any placement, or a
    :class:`redcoast.store.tensor_files.Deferred`) as a Hugging Face folder.

    Every process must call it (sharded arrays are gathered one at a time); process 0 writes.
    Tensors stream to the files one at a time (host memory near the largest tensor) and keep
    their dtype (bf16 stays bf16). Files appear complete: each is written under a temporary name
    and renamed.
    """
    entries = [entry(name, value) for name, value in tensors.items()]
    nbytes = lambda e: math.prod(e[1]) * e[2].itemsize  # noqa: E731
    groups = [entries]
    if max_shard_bytes:
        groups, size = [[]], 0
        for e in entries:
            if groups[-1] and size + nbytes(e) > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(e)
            size += nbytes(e)
    names = ([SINGLE_FILE] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    for name, group in zip(names, groups):
        write_safetensors(os.path.join(folder, name), group, metadata={"format": "pt"})
    if jax.process_index() != 0:
        return
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(nbytes(e) for e in entries)},
                 "weight_map": {e[0]: n for n, g in zip(names, groups) for e in g}}
        write_json(os.path.join(folder, INDEX_FILE), index)
    write_json(os.path.join(folder, "config.json"), config)


def write_json(path, obj):
    """Write ``obj`` as JSON whole or not at all (a temporary file renamed)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
    os.replace(tmp, path)
