"""A model folder's sharded index (``model.safetensors.index.json``) read from a stranger: its
weight_map a map of tensor names to files, each file resolved (symlinks followed) inside the
folder, so that an index cannot make a model load some other file on the machine as weights.

The one link allowed out is the Hugging Face hub cache's own layout: a snapshot folder
``models--org--name/snapshots/<revision>`` whose files link to ``models--org--name/blobs/``.
"""

import json
import os

from ..errors import ConfigError

REFETCH = ("download the model folder again (e.g. `hf download ORG/NAME --local-dir DIR`) or "
           "write it with save_pretrained")


def read_weight_map(index):
    """{tensor name: file name} of the index file ``index``, or a ConfigError naming it."""
    try:
        with open(index, encoding="utf-8") as f:
            content = json.load(f)
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{index} is not JSON ({e}). Fix: {REFETCH}.") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not (isinstance(weight_map, dict)
            and all(isinstance(v, str) for v in weight_map.values())):
        raise ConfigError(f"{index} has no weight_map of tensor names to file names (its "
                          f"weight_map is {_brief(weight_map)}). Fix: {REFETCH}.")
    return weight_map


def weight_file(folder, name, source):
    """The path of the weights file ``name`` that ``source`` (the index and its entry, for
    messages) names in ``folder``: a file that exists and, resolved, lies inside ``folder``."""
    root = os.path.realpath(folder)
    path = os.path.join(root, name)
    real = os.path.realpath(path)
    if not (_inside(real, root) or _hub_blob(real, root)):
        raise ConfigError(f"{source} names {name!r}, which resolves to {real}, outside the "
                          f"model folder {root}; redcoast reads a model's weights from its "
                          f"own folder only. Fix: {REFETCH}, or move the file into the "
                          "folder and name it there.")
    if not os.path.isfile(real):
        raise ConfigError(f"{source} names {name!r}, which is not a file in {root}. Fix: "
                          f"{REFETCH}.")
    return path


def _inside(path, root):
    return os.path.commonpath([path, root]) == root and path != root


def _hub_blob(real, root):
    """Whether ``real`` is a blob of the hub cache repository whose snapshot ``root`` is."""
    snapshots = os.path.dirname(root)
    if os.path.basename(snapshots) != "snapshots":
        return False
    return os.path.dirname(real) == os.path.join(os.path.dirname(snapshots), "blobs")


def _brief(value):
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
