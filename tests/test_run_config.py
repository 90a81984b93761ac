"""A run as data (redcoast/cli/run_config.py): the record round-trips through YAML and JSON, names
what is wrong in a file or an override, takes overrides, and keeps up with the keywords of
Deployer, Trainer and fit."""

import dataclasses
import inspect
import json
import subprocess
import sys

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec

from redcoast.deployer import Deployer
from redcoast.errors import ConfigError
from redcoast.cli.run_config import (NOT_DATA, DeployerConfig, FitConfig, LoRAConfig, RunConfig,
                                 TrainerConfig)
from redcoast.trainer import Trainer

pytest.importorskip("draccus")
pytest.importorskip("yaml")

# each section beside the callable whose keywords it mirrors
MIRRORS = [("Deployer", Deployer.__init__, DeployerConfig),
           ("Trainer", Trainer.__init__, TrainerConfig),
           ("fit", Trainer.fit, FitConfig)]


def unusual_record():
    """A record with no field at its default where it can be helped: every kind of value."""
    return RunConfig(
        deployer=DeployerConfig(jax_seed=7, n_model_shards="auto", workdir="/tmp/w",
                                wandb_init_kwargs={"project": "p", "tags": ["a", "b"]},
                                memory_budget_bytes=2 ** 33),
        trainer=TrainerConfig(accumulate_grad_batches=4, compute_dtype="bfloat16", fsdp=False,
                              params_sharding_rules=[(("layers", r"\d+", "q_proj", "kernel"),
                                                      (None, "mp"))], eval_by="batch"),
        fit=FitConfig(per_device_batch_size=3, n_epochs=None, max_steps=100,
                      save_argmin_ckpt_by_metrics=["loss"], keep_last_n_ckpts=2, shuffle=False),
        lora=LoRAConfig(rank=4, alpha=0.5, targets="q_proj"),
        export="out: with a colon", eval_at_start=True)


def test_yaml_and_json_round_trip_exactly():
    record = unusual_record()
    text = record.to_yaml()
    assert RunConfig.from_yaml(text) == record
    assert RunConfig.from_yaml(text).to_yaml() == text  # the same file again
    assert RunConfig.from_json(record.to_json()) == record
    assert RunConfig.from_yaml("") == RunConfig()  # an empty file: every default
    # what the file says is what a reader without redcoast sees
    import yaml
    raw = yaml.safe_load(text)
    assert raw["deployer"]["n_model_shards"] == "auto" and raw["fit"]["n_epochs"] is None
    assert raw["trainer"]["params_sharding_rules"] == [[["layers", r"\d+", "q_proj", "kernel"],
                                                        [None, "mp"]]]
    assert json.loads(record.to_json())["optimizer"]["learning_rate"] == 1e-4


def test_save_and_load_by_extension(tmp_path):
    record = unusual_record()
    for name in ("run.yaml", "run.json"):
        record.save(str(tmp_path / name))
        assert RunConfig.load(str(tmp_path / name)) == record
    assert (tmp_path / "run.json").read_text().startswith("{")


def test_an_unknown_key_is_named_with_the_valid_ones_and_a_close_match():
    with pytest.raises(ConfigError) as e:
        RunConfig.from_yaml("trainer:\n  fsdb: false\n", "run.yaml")
    message = str(e.value)
    assert "run.yaml: unknown key 'trainer.fsdb' (did you mean trainer.fsdp?)" in message
    assert "Valid keys at trainer: accumulate_grad_batches, params_sharding_rules" in message
    with pytest.raises(ConfigError, match=r"unknown key 'lorra' \(did you mean lora\?\). Valid "
                                          r"keys at the top level: deployer, trainer, fit"):
        RunConfig.from_yaml("lorra: {rank: 2}")
    with pytest.raises(ConfigError, match="unknown key 'zzz'. Valid keys"):  # nothing close
        RunConfig.from_yaml("zzz: 1")


def test_values_of_the_wrong_shape_or_type_are_named():
    with pytest.raises(ConfigError, match="fit must be a mapping of keys to values, not int"):
        RunConfig.from_yaml("fit: 3")
    with pytest.raises(ConfigError, match=r"fit\.n_epochs.*Couldn't parse 'many' into an int"):
        RunConfig.from_yaml("fit: {n_epochs: many}")
    with pytest.raises(ConfigError, match="not valid YAML"):
        RunConfig.from_yaml("fit: [1, 2")
    with pytest.raises(ConfigError, match="not valid JSON"):
        RunConfig.from_json("{'fit': 1}")
    with pytest.raises(ConfigError, match="cannot read the run config .*nowhere.yaml"):
        RunConfig.load("/nowhere.yaml")


def test_overrides_replace_fields_and_keep_the_rest(tmp_path):
    path = str(tmp_path / "run.yaml")
    unusual_record().save(path)
    cfg = RunConfig.from_args([path, "--trainer.fsdp=true", "--fit.n_epochs", "5",
                               "--deployer.n_model_shards=2", "--fit.max_steps=null",
                               "--fit.save_argmax_ckpt_by_metrics=[acc, f1]",
                               "--optimizer.learning_rate=3e-4"])
    expected = unusual_record()
    expected = dataclasses.replace(
        expected, trainer=dataclasses.replace(expected.trainer, fsdp=True),
        deployer=dataclasses.replace(expected.deployer, n_model_shards=2),
        fit=dataclasses.replace(expected.fit, n_epochs=5, max_steps=None,
                                save_argmax_ckpt_by_metrics=["acc", "f1"]))
    expected = dataclasses.replace(expected, optimizer=dataclasses.replace(expected.optimizer,
                                                                           learning_rate=3e-4))
    assert cfg == expected
    assert RunConfig.from_args(["--lora.rank=2"]).lora.rank == 2  # no file: the defaults


def test_an_unknown_override_is_named_with_a_close_match(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown option --trainer\.fsdb \(did you mean "
                                          r"--trainer\.fsdp\?\)\. Valid here: "
                                          r"--trainer\.accumulate_grad_batches"):
        RunConfig.from_args(["--trainer.fsdb=false"])
    with pytest.raises(ConfigError, match=r"did you mean --trainer\.fsdp\?"):
        RunConfig.from_args(["--trainr.fsdp=false"])
    with pytest.raises(ConfigError, match=r"--export\.path\. Valid after --export: none"):
        RunConfig.from_args(["--export.path=x"])
    with pytest.raises(ConfigError, match=r"fit\.max_steps.*Couldn't parse 'ten' into an int"):
        RunConfig.from_args(["--fit.max_steps=ten"])


@pytest.mark.parametrize("name, fn, section", MIRRORS, ids=[m[0] for m in MIRRORS])
def test_every_data_keyword_is_in_the_record_under_its_name_and_default(name, fn, section):
    """Fails when Deployer, Trainer or fit gain a keyword that the record lacks and NOT_DATA
    does not list, or lose one the record has; defaults must agree, so an empty file means no
    keyword at all (fit's required two excepted)."""
    params = {p: v for p, v in inspect.signature(fn).parameters.items() if p != "self"}
    fields = {f.name for f in dataclasses.fields(section)}
    excluded = set(NOT_DATA[name])
    assert not (fields & excluded), f"both in the record and excluded: {fields & excluded}"
    assert set(params) - fields - excluded == set(), \
        f"{name} keywords neither in {section.__name__} nor NOT_DATA: add them"
    assert fields - set(params) == set(), f"{section.__name__} fields {name} does not take"
    assert excluded - set(params) == set(), f"NOT_DATA names {name} keywords it no longer takes"
    given = section().kwargs()
    for key, param in params.items():
        if key in fields and param.default is not inspect.Parameter.empty:
            if key == "compute_dtype":
                assert jnp.dtype(given[key]) == jnp.dtype(param.default)
            else:
                assert given[key] == param.default, key
    required = {k for k, p in params.items() if p.default is inspect.Parameter.empty} - excluded
    assert required <= {"per_device_batch_size", "n_epochs"}


def test_keyword_arguments_are_what_the_callables_take():
    kwargs = unusual_record().trainer_kwargs()
    assert kwargs["compute_dtype"] is jnp.bfloat16
    assert kwargs["params_sharding_rules"] == [(("layers", r"\d+", "q_proj", "kernel"),
                                                PartitionSpec(None, "mp"))]
    with pytest.raises(ConfigError, match="trainer.compute_dtype='float33' is not a dtype"):
        TrainerConfig(compute_dtype="float33").kwargs()
    cfg = RunConfig.from_yaml("deployer: {jax_seed: 3, n_model_shards: 2, verbose: false}")
    deployer = Deployer(**cfg.deployer_kwargs())
    assert (deployer.jax_seed, deployer.n_model_shards, deployer.verbose) == (3, 2, False)
    assert RunConfig().fit_kwargs()["per_device_batch_size"] == 8
    from redcoast.lora import DEFAULT_TARGETS, LoRA
    assert LoRAConfig().targets == DEFAULT_TARGETS and LoRAConfig().alpha == LoRA().alpha


def test_missing_libraries_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "draccus", None)  # import draccus raises ImportError
    with pytest.raises(ConfigError, match=r"needs draccus. Fix: pip install 'redcoast\[train\]'"):
        RunConfig.from_yaml("fit: {n_epochs: 2}")
    from redcoast.cli.train_command import main
    assert main(["run.yaml"]) == 2


def test_the_core_does_not_import_the_record_or_draccus():
    code = ("import sys, redcoast, redcoast.cli.main, redcoast.cli.launch_command; "
            "print(sorted(m for m in ('draccus', 'redcoast.cli.run_config') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------ the fine-tune's options

# (values no run can mean: tests/test_run_record.py's lists, the fine-tune's options among them)


def test_a_choice_is_checked_with_a_close_match_in_the_file_and_on_the_command_line():
    with pytest.raises(ConfigError, match=r"run.yaml: data.format: 'mesages' is not one of auto, "
                                          r"text, prompt_completion, messages \(did you mean "
                                          r"messages\?\)"):
        RunConfig.from_yaml("data: {format: mesages}", "run.yaml")
    with pytest.raises(ConfigError, match=r"--lora.save: 'pef' is not one of merged, peft, both "
                                          r"\(did you mean peft\?\)"):
        RunConfig.from_args(["--lora.save=pef"])
    # draccus's own refusal of a choice (argparse's) is a ConfigError too, not a traceback
    with pytest.raises(ConfigError, match="invalid choice: 'x'"):
        RunConfig.from_args(["--model.task", "x"])
    cfg = RunConfig.from_args(["--data.format=messages", "--data.packing=true",
                               "--data.eval_fraction=0.05", "--model.remat=true",
                               "--lora.save=both"])
    assert (cfg.data.format, cfg.data.packing, cfg.data.eval_fraction, cfg.model.remat,
            cfg.lora.save) == ("messages", True, 0.05, True, "both")


def test_trl_and_axolotl_names_say_what_they_are_called_here():
    with pytest.raises(ConfigError, match=r"unknown key 'data.sample_packing' \(sample_packing "
                                          r"is data.packing here\)"):
        RunConfig.from_yaml("data: {sample_packing: true}")
    with pytest.raises(ConfigError, match=r"unknown key 'val_set_size' \(val_set_size is "
                                          r"data.eval_fraction here\)"):
        RunConfig.from_yaml("val_set_size: 0.1")
    with pytest.raises(ConfigError, match=r"unknown option --model.gradient_checkpointing "
                                          r"\(gradient_checkpointing is model.remat here\)"):
        RunConfig.from_args(["--model.gradient_checkpointing=true"])
