"""A model folder's sharded index (``model.safetensors.index.json``) read from a stranger: its
weight_map a map of tensor names to files, each file resolved (symlinks followed) inside the
folder by :func:`redcoast.store.folder_files.file_in_folder`, so that an index cannot make a model
load some other file on the machine as weights (a hub cache snapshot's links into its blobs
are followed).
"""

import os

from ..errors import ConfigError
from ..store.folder_files import file_in_folder, read_json_object

REFETCH = ("download the model folder again (e.g. `hf download ORG/NAME --local-dir DIR`) or "
           "write it with save_pretrained")


def read_weight_map(index):
    """{tensor name: file name} of the index file ``index``, or a ConfigError naming it."""
    weight_map = read_json_object(index, REFETCH).get("weight_map")
    if not (isinstance(weight_map, dict)
            and all(isinstance(v, str) for v in weight_map.values())):
        raise ConfigError(f"{index} has no weight_map of tensor names to file names (its "
                          f"weight_map is {_brief(weight_map)}). Fix: {REFETCH}.")
    return weight_map


def weight_file(folder, name, named_by):
    """The path of the weights file ``name`` in ``folder``, which ``named_by`` (the index entry,
    for messages) names: a file that exists and, resolved, lies inside ``folder``."""
    path = file_in_folder(folder, name, named_by)
    if not os.path.isfile(path):
        raise ConfigError(f"{named_by} names {name!r}, which is not a file in {folder}. Fix: "
                          f"{REFETCH}.")
    return path


def _brief(value):
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
