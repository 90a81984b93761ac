"""A model's Hugging Face config.json, read with errors that name the file and the field."""

import dataclasses
import json
import os
import types
import typing

from ..errors import ConfigError

_FIX = "Fix: give the model's config.json as Hugging Face writes it (config.save_pretrained)"


def config_path(config):
    """The config.json of ``config``: the file itself, or the one in the folder."""
    config = os.fspath(config)
    return config if os.path.isfile(config) else os.path.join(config, "config.json")


def read_model_config(config):
    """The fields of ``config`` (a config.json, or a folder holding one), checked to be ones
    redcoast's model of its ``model_type`` can be built from; a :class:`ConfigError` naming
    the file, and the field where one is at fault, if not."""
    path = config_path(config)
    try:
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {path}. Fix: give a Hugging Face config.json, or a "
                          "folder holding one.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} cannot be read: {e}. {_FIX}.") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not JSON ({e.msg} at line {e.lineno}, column {e.colno}). "
                          f"{_FIX}.") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"{path} holds a JSON {type(fields).__name__}, not an object of fields "
                          f"(\"model_type\": ..., \"hidden_size\": ...). {_FIX}.")
    check_model_config(fields, path)
    return fields


def check_model_config(fields, where):
    """Raise a :class:`ConfigError` naming ``where`` (the file) and the field when redcoast's
    model of ``fields["model_type"]`` cannot be built from ``fields``."""
    from ..models.pretrained import family_of
    model_type = fields.get("model_type")
    if model_type is None:
        raise ConfigError(f"{where} has no field \"model_type\", which says which model it "
                          f"configures. {_FIX}.")
    try:
        family = family_of(model_type)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e} Fix: a config of one of those model types.") from None
    misread = _numbers_misread(fields, family.Config)
    texts = [name for name, value in misread if isinstance(value, str)]
    if texts:  # "hidden_size": "big" would fail deeper, or not at all
        raise _wrong_type(where, model_type, texts[0], fields, family.Config)
    try:
        family.Config.from_hf(fields)
    except KeyError as e:
        raise ConfigError(f"{where} has no field {json.dumps(e.args[0])}, which redcoast's "
                          f"{model_type} model needs. {_FIX}.") from None
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except (TypeError, ValueError, ArithmeticError) as e:  # a value of the wrong kind or range
        if misread:  # a null where a number belongs, which the family did not fill in
            raise _wrong_type(where, model_type, misread[0][0], fields, family.Config) from None
        raise ConfigError(f"{where}: redcoast's {model_type} config cannot be built from its "
                          f"fields ({type(e).__name__}: {e}); a field holds a value of the wrong "
                          f"type or range. {_FIX}.") from None


def _numbers_misread(fields, config_class):
    """``[(name, value)]``: the fields given a text, or a null, where the config class reads a
    number (by its annotations; none when they cannot be read)."""
    try:
        hints = typing.get_type_hints(config_class)
    except Exception:  # an annotation this Python cannot resolve: the build still checks
        return []
    names = {f.name for f in dataclasses.fields(config_class)}
    misread = []
    for name, value in fields.items():
        kind, optional = _number_kind(hints.get(name)) if name in names else (None, True)
        if kind is not None and (isinstance(value, str) or (value is None and not optional)):
            misread.append((name, value))
    return misread


def _wrong_type(where, model_type, name, fields, config_class):
    kind, _ = _number_kind(typing.get_type_hints(config_class)[name])
    return ConfigError(f"{where}: field {json.dumps(name)} is {json.dumps(fields[name])}; "
                       f"redcoast's {model_type} config reads it as {kind}. Fix: write the "
                       f"number, without quotes (e.g. \"{name}\": "
                       f"{1e-6 if kind == 'a number' else 64}).")


def _number_kind(annotation):
    """``(kind, optional)``: kind 'an integer' or 'a number' for an int or float annotation
    (None for any other), optional when None is allowed too."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)  # Optional[int], int | None
    args = typing.get_args(annotation) if union else ()
    optional = type(None) in args
    if optional and len(args) == 2:
        annotation = next(a for a in args if a is not type(None))
    return {int: "an integer", float: "a number"}.get(annotation), optional
