"""redcoast plan's targets: NVIDIA GPUs compiled for by the GPU compiler with no GPU here, and a
compiler's refusal of a step as a verdict, whatever the compiler and its wording."""

import importlib.metadata
import json
import os

import jax
import pytest

from redcoast.cli import gpu_targets
from redcoast.cli.plan_command import TARGETS, PlanError, plan
from test_memory_check import TPU_REFUSAL_LIBTPU_0_0_42, TPU_REFUSAL_USED_OF
from test_plan import TINY

GIB = 2**30
# before JAX starts its backends (at the first test that asks for devices): else the CUDA
# plugin's driver check fails then, with no GPU here, and it never registers (as the GPU
# target's PlanError explains to a user)
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _cuda_plugin():
    for package in gpu_targets.CUDA_PLUGINS:
        try:
            return importlib.metadata.version(package) == jax.__version__
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


needs_cuda_plugin = pytest.mark.skipif(
    not _cuda_plugin(), reason="JAX's CUDA plugin is not installed (CI's steps 1 and 2 install "
    "jax[cuda12] in a separate environment and run these tests there, slow ones included)")


# each GPU's marketed memory and compute capability (NVIDIA's data sheets)
GPUS = {"h100": (80, (9, 0), "H100"), "h200": (141, (9, 0), "H200"),
        "a100": (80, (8, 0), "A100"), "a100-40gb": (40, (8, 0), "A100")}


def test_each_gpu_target_is_described_with_where_each_number_comes_from():
    assert set(gpu_targets.names()) == set(GPUS) and set(GPUS) <= set(TARGETS)
    for name, (gb, capability, model) in GPUS.items():
        desc = gpu_targets.description(name)
        info = desc["gpu_device_info"]
        assert set(desc["sources"]) == set(info) | {"device_kind", "dnn_version_info"}, name
        assert all(desc["sources"].values()), name
        # "80 GB" are GiB of HBM; the driver reports them less what it reserves (under 1 GiB)
        assert (gb - 1) * GIB < gpu_targets.device_memory_bytes(name) <= gb * GIB, name
        cc = info["cuda_compute_capability"]
        assert (cc["major"], cc["minor"]) == capability and model in desc["device_kind"]
        text = gpu_targets.target_config_text(desc)
        assert f"device_memory_size: {info['device_memory_size']}\n" in text
        assert f"cuda_compute_capability {{\n    major: {capability[0]}\n" in text
        assert text.count("{") == text.count("}") == 3
        assert f'device_description_str: "{desc["device_kind"]}"' in text


def test_a_gpu_target_without_the_cuda_plugin_says_what_to_install(tiny_config, monkeypatch):
    installed = importlib.metadata.version

    def without_plugins(name):
        if name in gpu_targets.CUDA_PLUGINS:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed(name)
    monkeypatch.setattr(importlib.metadata, "version", without_plugins)
    with pytest.raises(PlanError, match=rf"pip install 'jax\[cuda12\]=={jax.__version__}' \(or "
                                        rf"'jax\[cuda13\]=={jax.__version__}'.*--target cpu"):
        plan(tiny_config, devices=8, hosts=1, device_memory="80GiB", seq_len=32, target="h100")
    # a plugin of another jax is no plugin for this one
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1" if name ==
                        "jax-cuda12-plugin" else without_plugins(name))
    with pytest.raises(PlanError, match=r"found jax-cuda12-plugin 0\.0\.1"):
        plan(tiny_config, devices=8, hosts=1, device_memory="80GiB", seq_len=32, target="h100")


def test_a_gpu_server_holds_at_most_8_gpus_a_host(tiny_config):
    with pytest.raises(PlanError, match=r"1 to 8 GPUs.*--devices 16 --hosts 2"):
        plan(tiny_config, devices=16, hosts=1, device_memory="80GiB", seq_len=32, target="h100")


@pytest.mark.slow  # 18 s: the same step compiled by XLA:GPU and XLA:CPU
@needs_cuda_plugin
def test_a_gpu_server_is_planned_by_the_gpu_compiler_without_a_gpu(tiny_config):
    """8 H100s on 2 hosts described to XLA:GPU: the CPU stand-in's layout and state, the GPU
    compiler's memory."""
    ask = dict(devices=8, hosts=2, device_memory="80GiB", seq_len=32, model_shards=4,
               remat=False, scan_layers=False)
    gpu = plan(tiny_config, target="h100", **ask)
    cpu = plan(tiny_config, **ask)
    assert gpu.compiler.startswith("the GPU compiler (XLA:GPU through jax-cuda")
    assert "8 x NVIDIA H100 80GB HBM3 (4 a host, compute capability 9.0)" in gpu.compiler
    assert gpu.layout == cpu.layout and gpu.layout.startswith("dp=2 x mp=4")
    assert (gpu.params_bytes, gpu.optimizer_bytes) == (cpu.params_bytes, cpu.optimizer_bytes)
    assert gpu.per_device_peak_bytes >= gpu.params_bytes + gpu.optimizer_bytes
    assert gpu.fits and gpu.temporary_bytes > 0 and gpu.compile_seconds > 0


# a Llama whose MLP and untied head weigh more a model shard than the 256 rows a step they read
HEAVY_WEIGHTS = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=16000,
                     hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                     tie_word_embeddings=False)


@pytest.mark.slow  # 9 s: compiled twice by XLA:GPU
@needs_cuda_plugin
def test_weights_heavier_than_their_rows_left_to_the_gpu_compiler_take_less_memory(tmp_path, monkeypatch):
    """FSDP-split weights heavier than the rows they read are left to the partitioner
    (sharding/stationary_weights.py): XLA:GPU then keeps less (measured: 0.03 against 0.06 GiB of
    temporaries here; TinyLlama's 22 layers at 128 tokens x 2 a device on 4 x 2: 2.75 against
    3.98 GiB a device, and 33% fewer bytes over 'dp')."""
    from redcoast.layout import steps

    path = tmp_path / "config.json"
    path.write_text(json.dumps(HEAVY_WEIGHTS))
    ask = dict(devices=8, device_memory="80GiB", seq_len=64, model_shards=2, remat=False,
               scan_layers=False, target="h100")
    left = plan(str(path), **ask)
    monkeypatch.setattr(steps, "left_to_partitioner", lambda *args: set())
    gathered = plan(str(path), **ask)
    assert left.layout == gathered.layout and left.layout.startswith("dp=4 x mp=2")
    assert left.temporary_bytes < 0.75 * gathered.temporary_bytes
    assert left.per_device_peak_bytes < gathered.per_device_peak_bytes


@pytest.fixture
def cudnn_attention(monkeypatch):
    """The model's attention on cuDNN, as a bfloat16 run on an NVIDIA GPU traces it (redcoast's
    plan computes its blocked XLA attention instead: plan_command.planned_attention). JAX asks
    for cuDNN's library and the GPU's compute capability while tracing, neither here; compiling
    needs neither. Returns the kernels chosen. Fails loudly where JAX renames what is patched."""
    return trace_cudnn(monkeypatch)


def trace_cudnn(monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    from redcoast.cli import plan_command
    from redcoast.models import attention
    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(cudnn, "is_cuda_compute_capability_equal", lambda capability: False)
    monkeypatch.setattr(attention, "cuda_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(plan_command, "planned_attention", lambda *args: None)
    chosen, choose = [], attention.choose_implementation

    def recorded(*args, **kwargs):
        choice = choose(*args, **kwargs)
        chosen.append(choice.implementation)
        return choice
    monkeypatch.setattr(attention, "choose_implementation", recorded)
    return chosen


def llama_config(tmp_path, hidden, heads, kv_heads, sliding_window=None):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(
        model_type="mistral" if sliding_window else "llama", vocab_size=4096,
        architectures=["MistralForCausalLM" if sliding_window else "LlamaForCausalLM"],
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
        tie_word_embeddings=False, sliding_window=sliding_window)))
    return str(path)


@pytest.mark.slow  # 3 s each: compiled by XLA:GPU
@needs_cuda_plugin
@pytest.mark.parametrize("hidden, heads, kv_heads, window, per_device_batch_size", [
    (1536, 12, 2, None, 1), (1024, 32, 4, None, 1), (1024, 32, 4, None, 8), (1024, 32, 4, 256, 1)],
    ids=["positions-split", "kv-heads-by-groups", "examples-split", "kv-repeated-windowed"])
def test_cudnns_attention_compiles_in_redcoasts_tensor_parallel_step(
        tmp_path, cudnn_attention, hidden, heads, kv_heads, window, per_device_batch_size):
    """On 8 model shards, as a bfloat16 run on 8 GPUs compiles it, where three of redcoast's
    choices failed the compile: 12 heads keep Q, K, V and O whole, and one sequence a device is
    too few to split by examples, so sharding/batch_split.py split their matmuls by positions,
    which XLA spread into cuDNN's attention ("Sharding on sequence dim is not allowed"); 4 K/V
    heads (TinyLlama's) were kept by groups of shards, on a second view of the mesh ("mesh should
    be the same across the entire program"); a Mistral's 4 K/V heads, repeated per query head,
    reached the kernel split unlike its queries ("Query, key and value should have same
    sharding": models/attention.py now splits them alike)."""
    record = plan(llama_config(tmp_path, hidden, heads, kv_heads, window), target="h100", devices=8,
                  device_memory="80GiB", seq_len=512, model_shards=8,
                  per_device_batch_size=per_device_batch_size, remat=False, scan_layers=False,
                  param_dtype="bfloat16")
    assert set(cudnn_attention) == {"cudnn"}
    assert record.layout.startswith("dp=1 x mp=8") and record.fits


@pytest.mark.slow  # 6 s: compiled twice by XLA:GPU
@needs_cuda_plugin
def test_the_plans_stand_in_for_cudnn_lays_the_parameters_out_as_the_run_does(tmp_path,
                                                                               monkeypatch):
    """The plan computes attention by blocks where the run calls cuDNN, and the run's step, holding
    cuDNN's call, keeps TinyLlama's 4 K/V heads replicated over 8 shards rather than by groups
    (sharding/device_bound.py): the plan's step holds such an operation too, so it lays the
    parameters out as the run does (it had planned them by groups: 6.13 against 7.01 MiB)."""
    config = llama_config(tmp_path, 1024, 32, 4)
    ask = dict(target="h100", devices=8, device_memory="80GiB", seq_len=512, model_shards=8,
               per_device_batch_size=1, remat=False, scan_layers=False, param_dtype="bfloat16")
    planned = plan(config, **ask)
    assert "blocked" in planned.attention
    chosen = trace_cudnn(monkeypatch)
    run = plan(config, **ask)
    assert set(chosen) == {"cudnn"} and run.layout == planned.layout
    assert (planned.params_bytes, planned.optimizer_bytes) == (run.params_bytes, run.optimizer_bytes)


@pytest.mark.slow  # 16 s: compiled twice by XLA:GPU
@needs_cuda_plugin
def test_a_step_over_a_gpus_memory_compiles_and_is_retried_with_remat(tiny_config):
    """XLA:GPU does not refuse a step too big (it warns and compiles): its memory analysis is
    the verdict, then the retry with remat (which fits this tiny model's step here)."""
    record = plan(tiny_config, devices=8, hosts=1, device_memory=400_000, seq_len=64,
                  target="a100-40gb", model_shards=8, scan_layers=False)
    assert "8 x NVIDIA A100-SXM4-40GB (8 a host, compute capability 8.0)" in record.compiler
    assert record.tried[0][0] == "dp=1 x mp=8" and record.tried[0][1] > 400_000
    assert record.remat and record.per_device_peak_bytes < record.tried[0][1]
    assert record.fits == (record.per_device_peak_bytes <= 400_000)


def test_a_compilers_refusal_is_does_not_fit_with_the_bytes_it_asked_for_then_remat(
        tiny_config, monkeypatch):
    """Each try refused (old libtpu's wording, then jax 0.10's libtpu's): no crash, the verdict
    with what the compiler said one device needs, the retry with remat, what would fit."""
    from redcoast.trainer import Trainer
    # without remat, with remat, with remat at half the sequence (for the suggestions)
    refusals = [TPU_REFUSAL_USED_OF, TPU_REFUSAL_LIBTPU_0_0_42, TPU_REFUSAL_USED_OF]

    def refuse(self, batch):
        raise jax.errors.JaxRuntimeError(refusals.pop(0))
    monkeypatch.setattr(Trainer, "compile_train_step", refuse)
    record = plan(tiny_config, devices=8, hosts=2, device_memory="30GiB", seq_len=32,
                  model_shards=4, scan_layers=False)
    # the whole need as the compiler said it (the state's arguments included), not state + it
    assert record.tried == [("dp=2 x mp=4", int(49.34 * GIB))]
    assert record.remat and not record.fits and record.per_device_peak_bytes == int(38.64 * GIB)
    assert record.temporary_bytes == int(38.64 * GIB) - record.params_bytes - record.optimizer_bytes
    assert "refused the step" in record.compiler and "(38.64G)" in record.compiler
    assert record.suggestions and not refusals


def test_any_other_compiler_error_is_named_with_the_config_and_target(tiny_config, monkeypatch):
    from redcoast.trainer import Trainer

    def fail(self, batch):
        raise jax.errors.JaxRuntimeError("INTERNAL: ptxas exited with non-zero error code 65280")
    monkeypatch.setattr(Trainer, "compile_train_step", fail)
    with pytest.raises(PlanError, match=r"(?s)XLA:CPU on 8 simulated devices .* failed to compile "
                       rf"the training step of {tiny_config} \(dp=2 x mp=4, seq 32.*ptxas exited"
                       r".*no verdict on memory"):
        plan(tiny_config, devices=8, hosts=2, device_memory="30GiB", seq_len=32, model_shards=4,
             scan_layers=False)


def test_a_layout_redcoast_fails_to_build_costs_that_candidate_not_the_plan(tiny_config,
                                                                            monkeypatch):
    """One layout's failure is an ERROR row, the next layout planned; when every layout fails,
    a PlanError names the first failure and the fix."""
    from redcoast.trainer import Trainer
    compile_step = Trainer.compile_train_step

    def fail_without_remat(self, batch):  # the first layout tried: without remat
        if not calls:
            calls.append(1)
            raise ValueError("Resource axis: mp:4 of P(None, 'mp:4') is not found in mesh")
        return compile_step(self, batch)
    calls = []
    monkeypatch.setattr(Trainer, "compile_train_step", fail_without_remat)
    record = plan(tiny_config, devices=8, hosts=2, device_memory="1GiB", seq_len=32,
                  model_shards=4, scan_layers=False)
    assert [c["status"] for c in record.candidates] == ["ERROR", "FITS"]
    assert record.candidates[0]["why"].startswith("Resource axis: mp:4") and record.remat

    def fail(self, batch):
        raise ValueError("Resource axis: mp:4 of P(None, 'mp:4') is not found in mesh")
    monkeypatch.setattr(Trainer, "compile_train_step", fail)
    with pytest.raises(PlanError, match=r"could not build the training step .* for any layout "
                       r"searched; the first \(dp=2 x mp=4\) failed with ValueError: Resource"):
        plan(tiny_config, devices=8, hosts=2, device_memory="1GiB", seq_len=32, model_shards=4,
             scan_layers=False)



@needs_cuda_plugin
def test_a_process_whose_jax_started_without_the_plugin_says_how_to_start_it():
    """JAX's backends started (with all platforms) before the GPU target: the plugin's driver
    check failed then and it never registered; the error says what to set."""
    import subprocess
    import sys
    code = ("import jax; jax.devices(); from redcoast.cli.plan_command import _target, PlanError\n"
            "try: _target('h100', 1, 1)\nexcept PlanError as e: print(e)")
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "JAX_PLATFORMS", "XLA_FLAGS")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "Fix: set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1" in done.stdout, done.stdout + done.stderr

# The compilers' own answers to a program too big for one device, live: a changed wording (or a
# compiler that starts or stops refusing) fails here, on each jax CI runs, instead of a user.
def _too_big_for_one(device):
    """A program needing 192 GiB on ``device``: a 64 GiB product sorted (not fusable away)."""
    from jax.sharding import SingleDeviceSharding
    a = jax.ShapeDtypeStruct((131072, 1024), jax.numpy.float32,
                             sharding=SingleDeviceSharding(device))
    return jax.jit(lambda a: jax.numpy.sort(a @ a.T, axis=0)[0].sum()).lower(a)


@needs_cuda_plugin
def test_the_gpu_compiler_does_not_refuse_a_step_too_big_its_memory_analysis_says_so():
    from redcoast.cli.plan_command import _target
    devices, _ = _target("h100", 1, 1)
    m = _too_big_for_one(devices[0]).compile().memory_analysis()  # warns, does not raise
    assert m.temp_size_in_bytes > gpu_targets.device_memory_bytes("h100")


def _has_libtpu():
    try:
        return bool(importlib.metadata.version("libtpu"))
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _has_libtpu(), reason="libtpu is not installed (CI's steps 1 and 2 "
                    "install it in a separate environment and run this test there)")
def test_the_tpu_compilers_refusal_is_read_in_this_libtpus_words():
    from redcoast.layout.memory_check import compiler_refusal
    from redcoast.cli.plan_command import _target
    devices, _ = _target("tpu-v4", 4, 1)
    with pytest.raises(jax.errors.JaxRuntimeError) as refused:
        _too_big_for_one(devices[0]).compile()
    refusal = compiler_refusal(refused.value)
    assert refusal is not None, str(refused.value)
    # the 0.5 GiB argument, the 64 GiB product and its 64 GiB sorted copy: the whole need
    assert refusal.needed_bytes == int(128.5 * GIB) and refusal.available_bytes < 32 * GIB


@needs_cuda_plugin
def test_the_gpu_compiler_draws_each_fresh_parameter_in_a_kernel_of_its_own():
    # XLA:GPU's multi-output fusion put all parameters of one shape into one kernel, whose
    # assembly grew faster than the layers: TinyLlama-1.1B's init compiled in 164 s on an H200
    # (models/base.py's INIT_COMPILER_OPTIONS). 2 layers of 256 are enough for it to fuse the
    # gate and up projections (4 outputs of one kernel without the options)
    import re

    from jax.sharding import SingleDeviceSharding

    from redcoast.cli.plan_command import _target
    from redcoast.models import Model
    from redcoast.models.llama import LlamaConfig, LlamaForCausalLM
    devices, _ = _target("h100", 1, 1)
    model = Model(LlamaForCausalLM, LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))

    def drawn_together(compiler_options):
        """The kernels of the init program that output more than one matrix: {name: outputs}."""
        text = model.init_program(0, SingleDeviceSharding(devices[0]),
                                  compiler_options=compiler_options).lower().compile().as_text()
        kernels = re.findall(r"^\s*%?(fused\S*) \(.*\) -> \((.*)\) \{$", text, flags=re.M)
        return {name: outputs for name, outputs in kernels
                if len(re.findall(r"f32\[\d+,\d+\]", outputs)) > 1}

    # XLA's own options fuse them (so this reading of the compiled program finds such kernels)
    assert drawn_together({}), "no kernel draws two matrices even with XLA's own options"
    # many outputs of one kernel with redcoast's: only the norms' ones, never drawn matrices
    assert not drawn_together(None)
