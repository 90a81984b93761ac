"""A run's record is the run (redcoast/cli/run_checks.py, run_record.py, resume_changes.py): values
no run can mean are refused before any work; a resume under another record is refused, each
change named, unless allowed, and then every record is kept; a Python fit resumed with another
length or schedule says so."""

import os

import numpy as np
import optax
import pytest

from redcoast import Deployer, Trainer
from redcoast.cli.run_checks import problems
from redcoast.cli.run_config import RunConfig
from redcoast.cli.run_record import Change, Resume, check_resume, keep
from redcoast.cli.train_command import main
from test_train_cli import demo_files, tiny_model
from tiny_lm import collate_fn, loss_fn, make_examples, make_model

pytest.importorskip("draccus")
pytest.importorskip("tokenizers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------------ values no run can mean

# (YAML, the one field named): each value has the right type and cannot be meant
REFUSED = [
    ("data: {max_length: 0}", "data.max_length"),
    ("fit: {per_device_batch_size: 0}", "fit.per_device_batch_size"),
    ("fit: {eval_per_device_batch_size: -2}", "fit.eval_per_device_batch_size"),
    ("fit: {n_epochs: 0}", "fit.n_epochs"),
    ("fit: {n_epochs: null}", "fit.n_epochs"),  # and no max_steps: no length at all
    ("fit: {max_steps: 0}", "fit.max_steps"),
    ("fit: {save_every_n_steps: 0}", "fit.save_every_n_steps"),
    ("fit: {save_every_k_epochs: -1}", "fit.save_every_k_epochs"),
    ("fit: {log_every_n_steps: 0}", "fit.log_every_n_steps"),
    ("fit: {keep_last_n_ckpts: 0}", "fit.keep_last_n_ckpts"),
    ("fit: {eval_every_n_steps: 5}", "fit.eval_every_n_steps"),  # no data.eval
    ("trainer: {accumulate_grad_batches: 0}", "trainer.accumulate_grad_batches"),
    ("trainer: {compute_dtype: float33}", "trainer.compute_dtype"),
    ("trainer: {eval_by: batches}", "trainer.eval_by"),
    ("model: {param_dtype: half-float}", "model.param_dtype"),
    ("optimizer: {learning_rate: -1.0e-3}", "optimizer.learning_rate"),
    ("optimizer: {learning_rate: .nan}", "optimizer.learning_rate"),
    ("optimizer: {weight_decay: -0.01}", "optimizer.weight_decay"),
    ("optimizer: {warmup_rate: -0.1}", "optimizer.warmup_rate"),
    ("optimizer: {warmup_rate: 1.5}", "optimizer.warmup_rate"),  # longer than the run
    ("optimizer: {schedule_type: cosin}", "optimizer.schedule_type"),
    ("optimizer: {max_grad_norm: 0}", "optimizer.max_grad_norm"),
    ("lora: {rank: -1}", "lora.rank"),
    ("lora: {rank: 4, alpha: 0}", "lora.alpha"),
    ("lora: {rank: 4, targets: 'q_proj('}", "lora.targets"),
    ("deployer: {n_model_shards: 0}", "deployer.n_model_shards"),
    ("deployer: {n_local_devices: 0}", "deployer.n_local_devices"),
    ("simulate_cpu_devices: 0", "simulate_cpu_devices"),
    # the fine-tune's options
    ("data: {eval_fraction: 0}", "data.eval_fraction"),
    ("data: {eval_fraction: 1.0}", "data.eval_fraction"),  # nothing left to train on
    ("data: {eval_fraction: 0.1, eval: e.jsonl}", "data.eval_fraction"),  # two eval sets
    ("data: {split_seed: -1}", "data.split_seed"),
    ("lora: {save: peft}\nexport: out", "lora.save"),  # no adapters: rank 0
    ("lora: {rank: 8, save: both}", "lora.save"),  # nowhere to write them
    ("model: {task: seq2seq}\ndata: {format: messages}", "data.format"),
    ("model: {task: seq2seq}\ndata: {packing: true}", "data.packing"),
]

# values at the edge of what is meant: allowed
ALLOWED = ["optimizer: {learning_rate: 0.0, warmup_rate: 1.0, weight_decay: 0.0}",
           "fit: {n_epochs: null, max_steps: 10}", "lora: {rank: 0, alpha: 0}",
           "deployer: {n_model_shards: auto}", "fit: {eval_every_n_steps: 5}\ndata: {eval: e}",
           "data: {eval_fraction: 0.1, split_seed: 3}\nfit: {eval_every_n_steps: 5}",
           "data: {format: messages, packing: true}\nmodel: {remat: true}",
           "lora: {rank: 8, save: peft}\nexport: out", "lora: {rank: 0, save: merged}"]


@pytest.mark.parametrize("text, field", REFUSED, ids=[f for _, f in REFUSED])
def test_a_value_no_run_can_mean_is_named_with_its_path_value_and_fix(text, field):
    cfg = RunConfig.from_yaml(text)
    value = cfg
    for name in field.split("."):
        value = getattr(value, name)
    found = problems(cfg)
    assert len(found) == 1, found
    assert found[0].startswith(f"{field}: {value!r} "), found
    assert f". Fix: set {field} to " in found[0]


@pytest.mark.parametrize("text", ALLOWED)
def test_values_at_the_edge_of_meaning_pass(text):
    assert problems(RunConfig.from_yaml(text)) == []


def test_the_defaults_and_the_example_pass():
    assert problems(RunConfig()) == []
    assert problems(RunConfig.load(os.path.join(ROOT, "examples", "train_yaml", "run.yaml"))) == []


def test_the_command_refuses_them_all_at_once_before_any_work(tmp_path, capsys):
    train, _ = demo_files(tmp_path, 8, 2)
    model = tiny_model(tmp_path / "model")
    (tmp_path / "run.yaml").write_text(
        f"deployer: {{workdir: {tmp_path / 'work'}}}\nmodel: {{path: {model}}}\n"
        f"data: {{train: {train}, max_length: 0}}\noptimizer: {{learning_rate: -1.0e-3}}\n")
    assert main([str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert "the run config holds 2 values no run can mean" in err
    assert ("data.max_length: 0 is not a positive number of tokens: every sequence would be cut "
            "to nothing, so the run would train on nothing (loss 0). Fix: set data.max_length to "
            "the longest sequence to train on") in err
    assert "optimizer.learning_rate: -0.001 is not a learning rate" in err
    assert not (tmp_path / "work").exists()  # nothing started: no workdir, no record


# ------------------------------------------------------------------------ a resume's record


def small_run(tmp_path):
    """A run config of the tiny Llama on 32 demo records (files made once per tmp_path):
    updates of 8 (2 x 4 data shards), saved at the end."""
    if not (tmp_path / "data").exists():
        demo_files(tmp_path, 32, 8)
        tiny_model(tmp_path / "model")
    text = (f"deployer: {{n_model_shards: 2, workdir: {tmp_path / 'work'}}}\n"
            "trainer: {fsdp: false, fuse_matmuls: false}\n"
            "fit: {per_device_batch_size: 2, n_epochs: 1, save_last_ckpt: true}\n"
            f"model: {{path: {tmp_path / 'model'}}}\n"
            f"data: {{train: {tmp_path / 'data' / 'train.jsonl'}, max_length: 24}}\n"
            "optimizer: {learning_rate: 0.01}\n")
    (tmp_path / "run.yaml").write_text(text)
    return str(tmp_path / "run.yaml")


def fake_checkpoint(workdir, step, record):
    """What check_resume reads of a checkpoint: its step's folder and the record in it."""
    files = workdir / "checkpoints" / "steps" / str(step) / "files"
    files.mkdir(parents=True)
    (files / "run.yaml").write_text(record)


def test_a_resume_under_another_record_is_refused_naming_each_change(tmp_path, capsys):
    path = small_run(tmp_path)
    stored = RunConfig.load(path).to_yaml()
    fake_checkpoint(tmp_path / "work", 4, stored)
    (tmp_path / "work" / "run.yaml").write_text(stored)
    args = [path, "--optimizer.learning_rate=0.02", "--fit.n_epochs=2", "--deployer.verbose=false"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"the workdir holds a run at step 4 ({tmp_path / 'work'}/checkpoints/steps/4) " \
           "recorded with other settings" in err
    listed = [line.strip() for line in err.splitlines() if " -> " in line]
    # the two that count; verbose does not change the numbers
    assert listed == ["fit.n_epochs: 1 -> 2", "optimizer.learning_rate: 0.01 -> 0.02"], err
    assert "--allow-changes" in err and "--fit.resume=false" in err
    assert (tmp_path / "work" / "run.yaml").read_text() == stored  # untouched
    assert not (tmp_path / "work" / "run-history").exists()

    # logging and locations do not count; a record stored with none is a change that does
    cfg = RunConfig.from_args([path, "--deployer.verbose=false", "--export=/elsewhere"])
    resume = check_resume(cfg)
    assert resume.step == 4 and resume.counted == []
    assert sorted(map(str, resume.changes)) == ["deployer.verbose: True -> False",
                                                "export: null -> '/elsewhere'"]
    (tmp_path / "work" / "checkpoints" / "steps" / "4" / "files" / "run.yaml").unlink()
    assert main([path]) == 2
    assert "(the record): none stored with" in capsys.readouterr().err
    # no checkpoint, or resume: false: nothing to compare
    assert check_resume(RunConfig.from_args([path, "--fit.resume=false"])) is None


@pytest.mark.slow  # two runs of the command, about 20 s (the parts: the tests around it)
def test_an_allowed_change_is_logged_and_both_records_are_kept(tmp_path, capfd):
    """A real run of 4 updates, resumed at its end with another n_epochs and learning rate:
    refused without --allow-changes, then trained on under the new record, which the workdir,
    its history and the new checkpoints hold beside the first."""
    path = small_run(tmp_path)
    assert main([path]) == 0
    work, steps = tmp_path / "work", tmp_path / "work" / "checkpoints" / "steps"
    first = (work / "run.yaml").read_text()
    assert sorted(os.listdir(steps)) == ["4"]  # 32 examples in updates of 8
    assert os.listdir(work / "run-history") == ["step-0.yaml"]
    assert (work / "run-history" / "step-0.yaml").read_text() == first
    capfd.readouterr()

    changed = [path, "--fit.n_epochs=2", "--optimizer.learning_rate=0.02"]
    assert main(changed) == 2
    assert "fit.n_epochs: 1 -> 2" in capfd.readouterr().err
    assert main(changed + ["--allow-changes"]) == 0
    log = "".join(capfd.readouterr())
    assert "resumed at step 4 with fit.n_epochs: 1 -> 2" in log
    assert "resumed at step 4 with optimizer.learning_rate: 0.01 -> 0.02" in log
    # fit's own comparison: the schedule was sized for 4 updates and is now for 8
    assert "n_epochs 1 -> 2; planned_updates 4 -> 8" in log
    second = (work / "run.yaml").read_text()
    assert RunConfig.from_yaml(second).fit.n_epochs == 2 and second != first
    assert sorted(os.listdir(work / "run-history")) == ["step-0.yaml", "step-4.yaml"]
    assert (work / "run-history" / "step-0.yaml").read_text() == first
    assert (work / "run-history" / "step-4.yaml").read_text() == second
    assert sorted(os.listdir(steps), key=int) == ["4", "8"]
    assert (steps / "4" / "files" / "run.yaml").read_text() == first
    assert (steps / "8" / "files" / "run.yaml").read_text() == second


def test_the_history_keeps_every_record_and_moves_an_earlier_runs_aside(tmp_path):
    """keep() on its own: a fresh start, resumes with and without changes, an attempt that
    saved nothing, and a fresh start over an earlier run's records."""
    work, said = tmp_path / "work", []
    history = work / "run-history"
    keep(str(work), "a", None, said.append, said.append)
    assert os.listdir(history) == ["step-0.yaml"] and (work / "run.yaml").read_text() == "a"
    keep(str(work), "a", None, said.append, said.append)  # the same run again: nothing new
    keep(str(work), "a", Resume(4, "a", ()), said.append, said.append)
    assert os.listdir(history) == ["step-0.yaml"] and said == []

    change = Change("optimizer.learning_rate", 0.01, 0.02)
    keep(str(work), "b", Resume(4, "a", (change,)), said.append, said.append)
    assert said[0] == "resumed at step 4 with optimizer.learning_rate: 0.01 -> 0.02"
    assert {p.name: p.read_text() for p in history.iterdir()} == {"step-0.yaml": "a",
                                                                 "step-4.yaml": "b"}
    # resumed again at 4 (the attempt under b saved nothing) under c: kept beside b
    keep(str(work), "c", Resume(4, "a", (change,)), said.append, said.append)
    assert (history / "step-4~1.yaml").read_text() == "c" and (work / "run.yaml").read_text() == "c"
    # a run from before the history: its record kept, where it started unknown
    old = tmp_path / "old"
    old.mkdir()
    (old / "run.yaml").write_text("x")
    keep(str(old), "y", Resume(9, "x", (change,)), said.append, said.append)
    assert {p.name: p.read_text() for p in (old / "run-history").iterdir()} == {
        "until-step-9.yaml": "x", "step-9.yaml": "y"}

    # afresh in the same workdir: the earlier run's records moved aside, none lost
    keep(str(work), "d", None, said.append, said.append)
    [aside] = [p for p in work.iterdir() if p.name.startswith("run-history.earlier-run-")]
    assert sorted(os.listdir(aside)) == ["step-0.yaml", "step-4.yaml", "step-4~1.yaml"]
    assert "moved to" in said[-1] and str(aside) in said[-1]
    assert os.listdir(history) == ["step-0.yaml"] and (work / "run.yaml").read_text() == "d"


# ------------------------------------------------------------------------ Trainer.fit, in Python

LR = 1e-2


def test_fit_resumed_with_another_length_names_each_change_and_the_learning_rates(tmp_path):
    """One trainer (one compilation) fitted for 1 epoch, then resumed from that checkpoint for 3
    with the schedule for 3: what fit compares is the Trainer's lr_schedule_fn (its optimizer
    keeps the first schedule here, which the comparison does not read)."""
    examples = make_examples(16)  # 2 updates of 8 an epoch
    model, params = make_model()
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=str(tmp_path), verbose=False)

    def schedule(n_epochs):
        return deployer.get_lr_schedule_fn(train_size=16, per_device_batch_size=2,
                                           n_epochs=n_epochs, learning_rate=LR)

    trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params,
                      optax.sgd(schedule(1)), lr_schedule_fn=schedule(1))
    trainer.fit(examples, 2, 1, save_last_ckpt=True, shuffle=False)
    trainer.lr_schedule_fn = schedule(3)
    trainer.fit(examples, 2, 3, save_last_ckpt=True, shuffle=False)
    assert trainer.step == 6
    [said] = [line for line in (tmp_path / "log.txt").read_text().splitlines()
              if "resuming at update 2" in line]
    # the schedules, independently: linear from LR to 0 over 2, then over 6 updates
    before, after = optax.linear_schedule(LR, 0.0, 2), optax.linear_schedule(LR, 0.0, 6)
    assert float(before(2)) == 0.0 and np.isclose(float(after(2)), LR * 4 / 6)
    assert (f"n_epochs 1 -> 3; planned_updates 2 -> 6; learning rate at update 2 (this "
            f"resume's) 0 -> {float(after(2)):.4g}.") in said
    assert "update 0" not in said  # the same rate at the first update: not listed
    assert "Fix: resume with that run's settings" in said
