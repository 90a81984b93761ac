"""redcoast plan: a model planned from its config.json alone, for hardware that is not here."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from redcoast.cli.plan_command import PlanError, parse_bytes, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 256,
        "tie_word_embeddings": False}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def test_a_plan_holds_at_least_the_state_its_layout_must_hold(tiny_config):
    # tensor parallel within a host, FSDP across; remat and scan searched
    record = plan(tiny_config, devices=8, hosts=2, device_memory="64MiB", seq_len=32,
                  model_shards=4, scan_layers=False)
    # embedding + head, 2 layers of (q, o; k, v at 4 of 8 heads; gate, up, down; 2 norms), a norm
    assert record.n_params == 2 * 128 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert record.layout.startswith("dp=2 x mp=4")
    state = record.params_bytes + record.optimizer_bytes + record.gradient_bytes
    # Adam's two moments, placed alike, and its step count
    assert 0 <= record.optimizer_bytes - 2 * record.params_bytes <= 8
    # each device holds an eighth of the fp32 parameters: plan runs with fsdp=True, which splits
    # every tensor over 'dp' as well (all of this model's divide by the 8 devices)
    assert record.params_bytes == 4 * record.n_params / 8
    assert record.per_device_peak_bytes >= state - record.gradient_bytes
    assert record.fits and not record.remat and not record.suggestions
    # the search: without remat is faster by estimate and fits, so remat is not compiled
    assert [(c["remat"], c["status"]) for c in record.candidates] == [(False, "FITS"),
                                                                     (True, "not compiled")]
    assert record.examples_per_step == 2 and record.est_step_seconds > 0
    assert "which fits" in record.candidates[1]["why"] and "estimated" in record.table()
    # the split is Megatron's: every matmul weight over the 4 model shards, nothing kept whole
    assert record.megatron_share <= 1.0 and not record.short_of_megatron
    assert f"{record.megatron_share:.2f}x its parameters per device" in record.table()
    # and its compiled step moves Megatron's bytes between the model shards (the plan's own ideal)
    assert 0.8 <= record.megatron_bytes <= 1.1 and not record.bytes_short_of_megatron
    assert f"{record.megatron_bytes:.2f}x its bytes between model shards" in record.table()


def test_a_plan_that_does_not_fit_says_what_would(tiny_config):
    # the state fits 400 kB, the step's temporaries do not: compiled, remat tried too
    record = plan(tiny_config, devices=8, hosts=1, device_memory=400_000, seq_len=64,
                  model_shards=4, scan_layers=False)
    assert record.params_bytes + record.optimizer_bytes + record.gradient_bytes < 400_000
    assert not record.fits and record.compile_seconds > 0
    assert record.remat and record.tried[0][0] == "dp=2 x mp=4"  # without remat: more memory
    assert record.tried[0][1] > record.per_device_peak_bytes
    assert [c["status"] for c in record.candidates] == ["DOES NOT FIT"] * 2
    # the sequence from how the temporaries scaled between 64 and 32 tokens
    assert any(s.startswith("--seq-len") and "between the compiles at 64 and 32" in s
               for s in record.suggestions), record.suggestions
    # the state alone does not fit 20 kB: nothing compiled, more devices suggested
    record = plan(tiny_config, devices=8, hosts=1, device_memory=20_000, seq_len=64,
                  model_shards=4, scan_layers=False)
    assert not record.fits and record.compile_seconds == 0 and "not compiled" in record.compiler
    assert record.candidates[1]["why"].startswith("the training state alone exceeds")
    assert any("devices of this memory (" in s for s in record.suggestions)


def test_a_plan_with_layers_scanned_holds_the_same_state(tiny_config):
    ask = dict(devices=8, hosts=2, device_memory="64MiB", seq_len=32, model_shards=4, remat=False)
    unrolled = plan(tiny_config, scan_layers=False, **ask)
    scanned = plan(tiny_config, scan_layers=True, **ask)
    assert scanned.scan_layers and "layers scanned" in scanned.table()
    assert (scanned.n_params, scanned.layout) == (unrolled.n_params, unrolled.layout)
    for field in ("params_bytes", "optimizer_bytes", "gradient_bytes"):
        assert getattr(scanned, field) == getattr(unrolled, field), field
    # the FLOPs counted in the step's trace, each scanned layer once per layer (XLA's cost
    # analysis counted the scan's body once: a fraction of the unrolled step's)
    assert scanned.flops_per_device == unrolled.flops_per_device > 0


def test_a_family_that_runs_its_layers_unrolled_cannot_plan_them_scanned(tiny_config,
                                                                          monkeypatch):
    import redcoast.cli.plan_command
    monkeypatch.setattr(redcoast.cli.plan_command, "_scannable", lambda model_type: False)
    with pytest.raises(PlanError, match="runs its layers unrolled"):
        plan(tiny_config, devices=8, device_memory="64MiB", seq_len=32, scan_layers=True)


def test_libtpu_held_by_another_process_says_so(tiny_config, monkeypatch):
    """libtpu's lockfile error (a second TPU plan beside a running one) is a PlanError with
    the fix, not JAX's 'Run sudo rm' advice."""
    import importlib.metadata

    import jax
    from jax.experimental import topologies

    def held(**_):
        raise jax.errors.JaxRuntimeError("ABORTED: Internal error when accessing libtpu "
                                         "multi-process lockfile. Run \"$ sudo rm "
                                         "/tmp/libtpu_lockfile\".")
    installed = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.0.0" if name == "libtpu" else installed(name))
    monkeypatch.setattr(topologies, "get_topology_desc", held)
    with pytest.raises(PlanError, match="ALLOW_MULTIPLE_LIBTPU_LOAD=1"):
        plan(tiny_config, devices=8, hosts=2, device_memory="32GiB", seq_len=32, target="tpu-v4")


def test_sizes_are_parsed():
    assert parse_bytes("40GiB") == 40 * 2**30 and parse_bytes("32 GB") == 32 * 10**9
    with pytest.raises(ValueError):
        parse_bytes("forty")


@pytest.mark.slow
def test_a_table_1_row_through_the_cli(tmp_path):
    """The paper's LLaMA-7B row (4 x A100, 40 GB each, length 1024, fp32 AdamW): the row that
    plans fastest (22 s of compiling on 2 cores; BART-Large's took 2.6 minutes in CI)."""
    out = tmp_path / "plan.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-m", "redcoast", "plan", os.path.join(ROOT, "benchmarks", "configs",
         "llama-7b.json"), "--devices", "4", "--device-memory", "40GB", "--seq-len", "1024",
         "--json", str(out)], capture_output=True, text=True, timeout=1200, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FITS" in done.stdout
    record = json.loads(out.read_text())
    assert record["fits"] and record["n_params"] > 6e9
    assert record["per_device_peak_bytes"] >= record["params_bytes"] + record["optimizer_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("flags, bytes_a_parameter", [
    ([], 16), (["--model-shards", "1"], 16),
    (["--model-shards", "1", "--param-dtype", "bfloat16"], 8)])
def test_llama_3_8b_on_8_devices_of_80_gib_at_4096_tokens_fits(tmp_path, flags, bytes_a_parameter):
    """Issue 46's case: FSDP over one 8-device host was DOES NOT FIT (209 GiB of temporaries);
    the plan now tries remat and scanned layers itself. The state is exact: parameters,
    gradients and AdamW's two moments over 8 devices (bf16: 2 + 2 + 2 x 2 bytes)."""
    out = tmp_path / "plan.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-m", "redcoast", "plan", os.path.join(ROOT, "benchmarks", "configs",
         "llama-3-8b.json"), "--devices", "8", "--device-memory", "80GiB", "--seq-len", "4096",
         "--json", str(out), *flags], capture_output=True, text=True, timeout=1200, cwd=ROOT,
        env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    assert record["fits"], done.stdout
    state = record["params_bytes"] + record["optimizer_bytes"] + record["gradient_bytes"]
    assert state == pytest.approx(bytes_a_parameter * record["n_params"] / 8, rel=0.03)
    assert record["host_memory_bytes"] < 6 * 2**30
    chosen = [c for c in record["candidates"] if c["status"] == "FITS"]
    assert len(chosen) == 1 and chosen[0]["remat"] == record["remat"]


def _has_libtpu():
    from importlib.metadata import PackageNotFoundError, version
    try:
        return bool(version("libtpu"))
    except PackageNotFoundError:
        return False


@pytest.mark.skipif(not _has_libtpu(), reason="libtpu is not installed (CI's step 2 installs it "
                    "after the suite and runs this test)")
def test_a_tpu_slice_is_planned_by_the_tpu_compiler_without_a_tpu(tiny_config):
    """TPU v4, 2 hosts x 4 chips, through libtpu's topology description: the same layout and
    state as the CPU stand-in's plan, the TPU compiler's own memory and FLOPs."""
    tpu = plan(tiny_config, devices=8, hosts=2, device_memory="32GiB", seq_len=32, target="tpu-v4")
    cpu = plan(tiny_config, devices=8, hosts=2, device_memory="32GiB", seq_len=32)
    assert tpu.compiler.startswith("the TPU compiler (libtpu") and "v4:2x2x2" in tpu.compiler
    assert tpu.layout == cpu.layout and tpu.layout.startswith("dp=2 x mp=4")
    assert (tpu.params_bytes, tpu.optimizer_bytes) == (cpu.params_bytes, cpu.optimizer_bytes)
    assert tpu.per_device_peak_bytes >= tpu.params_bytes + tpu.optimizer_bytes
    assert tpu.fits and tpu.flops_per_device > 0 and tpu.compile_seconds > 0


def test_a_target_that_cannot_be_planned_says_why_and_what_to_ask_instead(tiny_config):
    from redcoast.cli.plan_command import PlanError
    # a TPU v4 host has 4 chips: 8 chips on 1 host is no TPU v4 slice
    with pytest.raises(PlanError, match="4 chips a host"):
        plan(tiny_config, devices=8, hosts=1, device_memory="32GiB", seq_len=32, target="tpu-v4")
    if not _has_libtpu():
        with pytest.raises(PlanError, match=r"pip install 'jax\[tpu\]=="):
            plan(tiny_config, devices=8, hosts=2, device_memory="32GiB", seq_len=32,
                 target="tpu-v4")


@pytest.mark.skipif(not _has_libtpu(), reason="libtpu is not installed (CI's step 2 installs it "
                    "after the suite and runs this test)")
def test_a_trainer_for_a_tpu_slice_compiles_but_will_not_hold_parameters_here():
    import jax
    import optax

    from redcoast import ConfigError, Deployer, Trainer
    from redcoast.models import model_from_config
    from redcoast.cli.plan_command import _target
    devices, _ = _target("tpu-v4", 8, 2)
    model, abstract = model_from_config(TINY)
    deployer = Deployer(n_model_shards=4, verbose=False, memory_budget_bytes=2**30, devices=devices)
    trainer = Trainer(deployer, lambda rows: rows, model.apply,
                      lambda rng, state, params, batch, is_training: model.apply(params, batch["ids"]).mean(),
                      abstract, optax.adamw(1e-3))
    compiled = trainer.compile_train_step({"ids": jax.ShapeDtypeStruct((2, 16), "int32")})
    # the state's arguments: libtpu 0.0.42.1 (jax 0.10) reports no temporaries for this step
    assert compiled.memory_analysis().argument_size_in_bytes > 0
    assert {d.platform for d in trainer.mesh.devices.flat} == {"tpu"}
    with pytest.raises(ConfigError, match="compile-only target"):
        trainer.set_params(jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), abstract))


# -- arguments checked before any work (issue 48, case 6) -----------------------------------------

def test_a_size_is_a_finite_number_with_a_unit():
    assert parse_bytes("1.5e3MiB") == 1500 * 2**20 and parse_bytes("400000B") == 400_000
    assert parse_bytes(" 2 TiB ") == 2 * 2**40
    for text, needle in [("eGiB", "not a size"), ("1e400GiB", "not a finite size"),
                         ("40", "has no unit"), ("40 parsecs", "the unit 'parsecs'"),
                         ("0GiB", "less than a byte"), ("0.5B", "less than a byte"),
                         ("-1GiB", "not a size"), ("nanGiB", "not a size")]:
        with pytest.raises(PlanError, match="Fix") as e:
            parse_bytes(text)
        assert needle in str(e.value), text


@pytest.fixture
def no_work(monkeypatch):
    """Planning, or simulating devices, fails the test: the arguments must be refused first."""
    import redcoast.cli.plan_command
    import redcoast.simulate

    def work(*args, **kwargs):
        raise AssertionError("work started before the arguments were refused")
    monkeypatch.setattr(redcoast.cli.plan_command, "plan", work)
    monkeypatch.setattr(redcoast.simulate, "simulate_cpu_devices", work)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))


def refused(argv, capsys):
    from redcoast.cli.plan_command import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("flags, needle", [
    (["--seq-len", "0"], "argument --seq-len: '0' is not a positive integer"),
    (["--hosts", "0"], "argument --hosts: '0' is not a positive integer"),
    (["--devices", "0"], "argument --devices: '0' is not a positive integer"),
    (["--devices", "two"], "argument --devices: 'two' is not a positive integer"),
    (["--per-device-batch-size", "-1"], "argument --per-device-batch-size: '-1'"),
    (["--model-shards", "0"], "argument --model-shards: '0'"),
    (["--device-memory", "eGiB"], "argument --device-memory: not a size: 'eGiB'"),
    (["--device-memory", "1e400GiB"], "argument --device-memory: '1e400GiB' is not a finite size"),
    (["--device-memory", "40"], "argument --device-memory: '40' has no unit"),
    (["--devices", "6", "--hosts", "4"], "--devices 6 is not a multiple of --hosts 4"),
    (["--model-shards", "3"], "--model-shards 3 does not divide --devices 8"),
    (["--devices", "100000"], "--devices 100000 with --target cpu would start 100000 simulated"),
])
def test_the_cli_refuses_bad_arguments_before_any_work(tiny_config, no_work, capsys, flags, needle):
    base = {"--devices": "8", "--device-memory": "1GiB", "--seq-len": "32"}
    argv = [tiny_config] + [x for k, v in base.items() if k not in flags for x in (k, v)] + flags
    err = refused(argv, capsys)
    assert needle in err and "Traceback" not in err, err


@pytest.mark.parametrize("content, needle", [
    ("{not json", "is not JSON (Expecting property name enclosed in double quotes at line 1"),
    (json.dumps({**TINY, "hidden_size": "big"}),
     'field "hidden_size" is "big"; redcoast\'s llama config reads it as an integer'),
    (json.dumps({**TINY, "rms_norm_eps": "tiny"}), 'field "rms_norm_eps" is "tiny"'),
    (json.dumps({k: v for k, v in TINY.items() if k != "hidden_size"}),
     'has no field "hidden_size", which redcoast\'s llama model needs'),
    (json.dumps({**TINY, "hidden_size": None}), 'field "hidden_size" is null'),
    (json.dumps({k: v for k, v in TINY.items() if k != "model_type"}), 'no field "model_type"'),
    (json.dumps({**TINY, "model_type": "llama9"}), "model_type 'llama9' is not supported"),
    (json.dumps([TINY]), "holds a JSON list, not an object of fields"),
])
def test_a_config_file_that_cannot_be_read_names_the_file_and_the_field(tmp_path, no_work, capsys,
                                                                         content, needle):
    path = tmp_path / "config.json"
    path.write_text(content)
    err = refused([str(tmp_path), "--devices", "8", "--device-memory", "1GiB", "--seq-len", "32"],
                  capsys)
    assert f"{path}" in err and needle in err and "Fix" in err and "Traceback" not in err, err
    err = refused([str(tmp_path / "elsewhere"), "--devices", "8", "--device-memory", "1GiB",
                   "--seq-len", "32"], capsys)
    assert f"no config.json at {tmp_path / 'elsewhere' / 'config.json'}" in err


def test_plan_itself_refuses_what_cannot_be_planned_before_compiling(tiny_config, tmp_path):
    from redcoast.errors import ConfigError
    ask = dict(devices=8, hosts=1, device_memory="1GiB", seq_len=32)
    for change, needle in [(dict(seq_len=0), "seq_len=0"), (dict(hosts=0), "hosts=0"),
                           (dict(devices=6, hosts=4), "devices=6 on hosts=4"),
                           (dict(device_memory=0), "device_memory=0"),
                           (dict(model_shards=3), "model_shards=3 does not divide devices=8"),
                           (dict(optimizer="adam"), "optimizer='adam'"),
                           (dict(devices=100000), "devices=100000: planning them would start")]:
        with pytest.raises(PlanError, match="Fix") as e:
            plan(tiny_config, **{**ask, **change})
        assert needle in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "hidden_size": "big"}))
    with pytest.raises(ConfigError, match='config.json: field "hidden_size" is "big"'):
        plan(str(tmp_path), **ask)


@pytest.mark.parametrize("config, needle", [
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64,
      "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 128,
      "intermediate_size": 128, "max_position_embeddings": 64}, "'bert' is an encoder"),
    ({"model_type": "vit", "architectures": ["ViTModel"], "hidden_size": 64,
      "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 128,
      "image_size": 32, "patch_size": 8}, "'vit' is an image model")], ids=["bert", "vit"])
def test_a_family_redcoast_builds_but_does_not_plan_is_refused_with_what_to_do(tmp_path, config,
                                                                              needle):
    """Not an AttributeError from inside the step (BERT's encoder returned a tuple to the plan's
    next-token loss): the plannable families, and how to measure this one."""
    from redcoast.cli.plan_command import CAUSAL, NOT_PLANNED, SEQ2SEQ
    from redcoast.models.pretrained import FAMILIES
    assert set(FAMILIES) == set(CAUSAL) | set(SEQ2SEQ) | set(NOT_PLANNED)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanError, match="Fix: build your Trainer") as e:
        plan(str(tmp_path), devices=8, device_memory="1GiB", seq_len=32)
    assert needle in str(e.value) and "llama" in str(e.value)


def test_the_configs_redcoast_plans_read_without_complaint():
    """No false alarm: every config of the benchmarks (the README's rows), and a null where
    Hugging Face fills in a default (num_key_value_heads: as many as the attention heads)."""
    import glob

    from redcoast.cli.config_file import check_model_config, read_model_config
    files = glob.glob(os.path.join(ROOT, "benchmarks", "configs", "*.json"))
    assert len(files) >= 10
    for path in files:
        assert read_model_config(path)["model_type"]
    check_model_config({**TINY, "num_key_value_heads": None}, "config.json")


def test_a_gpu_run_in_bfloat16_is_planned_with_a_flash_sized_attention():
    """Where the GPU would run cuDNN's flash kernel (bf16/fp16), the stand-in's step computes
    attention in blocks (O(seq) memory too); float32, TPUs and families without the option keep
    the model's own attention."""
    from redcoast.cli.plan_command import planned_attention
    assert planned_attention("cpu", "bfloat16", "llama") == "blocked"
    assert planned_attention("h100", "float16", "gpt2") == "blocked"
    assert planned_attention("cpu", "float32", "llama") is None
    assert planned_attention("tpu-v4", "bfloat16", "llama") is None
    assert planned_attention("cpu", "bfloat16", "t5") is None  # no attention_implementation


@pytest.mark.slow  # two plans at 2048 tokens: 8 s here
def test_blocked_attention_holds_a_block_of_scores_where_xla_holds_them_all(tiny_config,
                                                                            monkeypatch):
    import redcoast.cli.plan_command as plan_module
    # 2048 tokens: four blocks of 512 queries
    ask = dict(devices=8, hosts=1, device_memory="1GiB", seq_len=2048, model_shards=4,
               remat=True, scan_layers=False, param_dtype="bfloat16")
    blocked = plan(tiny_config, **ask)
    assert "blocked by 512 queries" in blocked.table()
    monkeypatch.setattr(plan_module, "planned_attention", lambda *args: None)
    full = plan(tiny_config, **ask)
    assert not full.attention and full.params_bytes == blocked.params_bytes
    # one layer's scores, [2 rows, 2 heads a device, 2048, 2048] (32 MiB in bf16, more with
    # their probabilities), held whole by XLA's attention and a block at a time by the blocked
    # one (here 121 MB of temporaries against 33)
    assert full.temporary_bytes - blocked.temporary_bytes > 32 * 2**20
    assert full.temporary_bytes > 2 * blocked.temporary_bytes


def test_a_stand_in_fit_close_to_the_device_says_to_ask_the_devices_compiler(tiny_config):
    ask = dict(devices=8, hosts=1, seq_len=32, model_shards=4, remat=False, scan_layers=False)
    roomy = plan(tiny_config, device_memory="64MiB", **ask)
    assert roomy.fits and not roomy.suggestions
    close = plan(tiny_config, device_memory=int(roomy.per_device_peak_bytes / 0.9), **ask)
    assert close.fits and close.per_device_peak_bytes == roomy.per_device_peak_bytes
    assert len(close.suggestions) == 1 and "90% of the device's memory" in close.suggestions[0]
    assert "--target h100" in close.suggestions[0] and "suggestion" in close.table()


def test_remat_over_more_model_shards_than_kv_heads(tiny_config):
    """8 model shards over TINY's 4 K/V heads split them over groups of the shards ('mp:4'); the
    gathers inside remat (sharding/remat_weights.py) constrained to that spec on the plain mesh,
    which names no 'mp:4': every such layout failed to build (a crash for a Trainer too)."""
    record = plan(tiny_config, devices=8, hosts=1, device_memory="64MiB", seq_len=32,
                  model_shards=8, remat=True, scan_layers=False)
    assert record.fits and record.remat and record.compile_seconds > 0
    assert [c["status"] for c in record.candidates] == ["FITS"]


def test_a_bfloat16_plan_computes_in_bfloat16(tmp_path):
    """--param-dtype bfloat16 plans bf16 training: activations in bf16 as well as the state.
    Before, the step computed in the Trainer's default float32 and held as many temporaries as
    a float32 plan; now 0.83x of them (the loss's logits and the softmax stay fp32). TINY
    widened to 128, 4 heads of 32, and 8 rows of 64 tokens a device, so that the activations
    weigh more than the attention's float32 softmax, the same in both. At TINY's heads of 8 and
    256 tokens the step's temporaries are 3.75 MB in float32 and 3.74 in bfloat16 with redcoast's
    attention (models/attention.py), 4.26 and 3.74 (0.88x) with jax's: this test's configuration
    until 2026-11-30."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(TINY, hidden_size=128, intermediate_size=512,
                                      num_attention_heads=4, num_key_value_heads=4)))
    ask = dict(devices=8, hosts=1, device_memory="1GiB", seq_len=64, per_device_batch_size=8,
               model_shards=4, remat=False, scan_layers=False)
    fp32, bf16 = plan(str(config), **ask), plan(str(config), param_dtype="bfloat16", **ask)
    assert bf16.params_bytes * 2 == fp32.params_bytes
    assert bf16.temporary_bytes < 0.9 * fp32.temporary_bytes
