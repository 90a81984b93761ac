"""Which modules a PEFT LoRA config adapts, by PEFT's own rules (``peft.tuners.tuners_utils.
check_target_module_exists`` and ``_maybe_include_all_linear_layers``, PEFT 0.21): PEFT builds a
model's adapters from ``adapter_config.json``'s ``target_modules``, then fills them from the
weights file, so a folder whose weights hold other modules than the config names is two models
in one folder; :func:`check_targets` refuses it.

- ``target_modules`` a list: a module is adapted when its name is in it, or ends with ``.`` and
  one of them (``"q_proj"`` adapts every layer's ``...self_attn.q_proj``);
- a string: a regular expression the whole name must match (``re.fullmatch``);
  ``"all-linear"`` (any case): every linear layer but the output embeddings (``lm_head``) and,
  for ``SEQ_CLS``, the classifier head;
- ``exclude_modules`` (the same two forms) takes modules out;
- ``layers_to_transform`` (with ``layers_pattern``) keeps, for a list, the modules of those
  layers only.
"""

import re

from ..errors import ConfigError

ALL_LINEAR = "all-linear"
OUTPUT_EMBEDDINGS = ("lm_head", "cls.predictions.decoder")  # get_output_embeddings() of a family
SEQ_CLS_HEADS = ("classifier", "score")  # peft.utils.constants.SEQ_CLS_HEAD_NAMES


def targeted(config, modules):
    """The names among ``modules`` (``{Hugging Face module name: whether it is a linear
    layer}``, a model's modules that can hold LoRA adapters) that ``config`` (adapter_config.json
    as a dict) adapts."""
    targets = config.get("target_modules")
    chosen = []
    for name, linear in modules.items():
        if _excluded(config.get("exclude_modules"), name):
            continue
        if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
            if linear and not _head(name, config.get("task_type")):
                chosen.append(name)
        elif isinstance(targets, str):
            if re.fullmatch(targets, name):
                chosen.append(name)
        elif name in targets or (_listed(targets, name) and _in_layers(config, name)):
            chosen.append(name)  # a full name is taken whatever layers_to_transform says
    return chosen


def check_targets(config, modules, held, weights_file, config_file):
    """A ConfigError where the modules the weights hold adapters for (``held``) are not those
    that ``config``'s ``target_modules`` adapt: the extra and the missing tensors named."""
    targets = config.get("target_modules")
    if targets is None or not isinstance(targets, (str, list, tuple)):
        raise ConfigError(f"{config_file} has target_modules={targets!r}: PEFT would take its "
                          "own default modules for the model type, which need not be those the "
                          "weights hold. Fix: set target_modules to the adapted modules' names "
                          '(e.g. ["q_proj", "v_proj"]), as peft_model.save_pretrained writes it.')
    wanted = set(targeted(config, modules))
    if not wanted and not held:
        raise ConfigError(f"{config_file}'s target_modules={targets!r} adapts no linear layer of "
                          "the model and its weights hold none: PEFT refuses such a folder. Fix: "
                          "load adapters trained for this model.")
    extra = sorted(set(held) - wanted)
    missing = sorted(wanted - set(held))
    if not (extra or missing):
        return
    said = []
    if extra:
        said.append(f"{weights_file} holds adapters of {len(extra)} modules that target_modules="
                    f"{targets!r} does not adapt (PEFT leaves them unread): "
                    f"{_tensors(extra)}")
    if missing:
        said.append(f"target_modules={targets!r} adapts {len(missing)} modules whose adapters "
                    f"{weights_file} lacks (PEFT keeps them as initialised): {_tensors(missing)}")
    raise ConfigError(f"{config_file} and its weights disagree: " + "; ".join(said) + ". PEFT "
                      "builds the model from target_modules, so PEFT and the weights alone would "
                      "be two models. Fix: set target_modules to the modules the weights hold, "
                      "or save the adapters again (peft_model.save_pretrained).")


def _tensors(modules):
    names = [f"base_model.model.{m}.lora_A.weight" for m in modules[:4]]
    return ", ".join(names) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")


def _listed(targets, name):
    return name in targets or any(name.endswith(f".{t}") for t in targets)


def _excluded(exclude, name):
    if not exclude:
        return False
    if isinstance(exclude, str):
        return re.fullmatch(exclude, name) is not None
    return _listed(exclude, name)


def _head(name, task_type):
    return name in OUTPUT_EMBEDDINGS or (task_type == "SEQ_CLS" and name in SEQ_CLS_HEADS)


def _in_layers(config, name):
    """PEFT's ``layers_to_transform``: the first numbered segment (after ``layers_pattern``
    where given) must be one of them."""
    layers = config.get("layers_to_transform")
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    patterns = config.get("layers_pattern")
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        match = None
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", name)
            if match is not None:
                break
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers
