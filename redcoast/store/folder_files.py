"""The files of a folder from someone else (a model or adapter folder) stay inside it.

A folder names its files by name (``adapter_config.json``, ``generation_config.json``, ...), but
a name can be a symbolic link, and a link can lead anywhere on the machine: a downloaded folder
whose ``adapter_model.safetensors`` links to ``../../other-model/...`` or ``/home/...`` would load
that file as its own. So every file is resolved (links followed) and must lie inside the folder.
One layout leads out by design and is kept working: Hugging Face's hub cache, whose
``snapshots/<revision>/`` files link into the same repository's ``blobs/``.
"""

import json
import os

from ..errors import ConfigError


def file_in_folder(folder, name, named_by):
    """The path of ``name`` in ``folder`` (whether or not it exists), or a ConfigError naming the
    file and ``named_by`` (what asked for it, e.g. "the adapter's weights") where the name or a
    link on its way leads outside the folder."""
    path = os.path.join(folder, name)
    if os.path.isabs(name):
        raise ConfigError(f"{named_by} names the absolute path {name!r}, outside {folder}: a "
                          "folder's files must lie inside it. Fix: put the file in the folder "
                          "and name it relative to the folder.")
    if not os.path.lexists(path):
        return path  # the caller says what is missing
    real, root = os.path.realpath(path), os.path.realpath(folder)
    if _inside(real, root) or any(_inside(real, blobs) for blobs in _hub_blobs(root)):
        if os.path.isdir(real):
            raise ConfigError(f"{path} ({named_by}) is a folder, not a file. Fix: put the file "
                              "itself there.")
        return path
    raise ConfigError(f"{path} ({named_by}) leads outside its folder {folder}, to {real}: a "
                      "folder from elsewhere could make redcoast read any file on the machine "
                      "as its own, so only files inside the folder are read. Fix: copy the "
                      "file into the folder (cp -L) instead of linking to it.")


def _inside(path, root):
    return os.path.commonpath([path, root]) == root


def _hub_blobs(root):
    """``[<repo>/blobs]`` where ``root`` (resolved) lies inside ``<repo>/snapshots/`` of a
    Hugging Face hub cache repository (one with a ``blobs`` folder); else ``[]``."""
    head = root
    while True:
        parent, base = os.path.split(head)
        if base == "snapshots" and os.path.isdir(os.path.join(parent, "blobs")):
            return [os.path.join(parent, "blobs")]
        if parent == head:
            return []
        head = parent


def read_json_object(path, fix):
    """The JSON object (a dict) in the file ``path``, or a ConfigError naming it and ``fix``."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON ({e}). Fix: {fix}.") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds a JSON {type(value).__name__}, not an object of "
                          f"settings. Fix: {fix}.")
    return value
