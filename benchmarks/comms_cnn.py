"""Convolutional networks through the Trainer: parameter share and per-block traffic vs Megatron.

For the ResNet- and RegNet/ResNeXt-style CNNs of tests/cnn_architectures.py on 8 simulated CPU
devices (2 data x 4 model shards), Trainer with every default: the parameter bytes device 0 holds
over its share (total / 4), and one block's model-parallel wire bytes (the training step compiled
at two depths, collectives differenced, redcoast/layout/comms.py) over Megatron's channel split: one
all-reduce of the block's [batch, H, W, C] output forward and one of its input gradient backward.

    PYTHONPATH=. python benchmarks/comms_cnn.py [resnet|regnet ...]

(PYTHONPATH=. runs this checkout's redcoast rather than an installed one.)
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import jax  # noqa: E402
import optax  # noqa: E402

from cnn_architectures import CNNS, block_activations, collate, examples  # noqa: E402
from redcoast import Deployer, Trainer  # noqa: E402
from redcoast.layout.comms import megatron_conv_ideal, per_layer  # noqa: E402

N, PER_DEVICE, BLOCKS = 4, 2, 2


def trainer_for(name, n_blocks):
    arch = CNNS[name](n_blocks=n_blocks)
    return Trainer(Deployer(n_model_shards=N, jax_seed=0, verbose=False), collate, arch.model.apply,
                   arch.loss_fn, arch.params, optax.sgd(0.01))


def device0_share(trainer):
    device = jax.devices()[0]
    held = total = 0
    for x in jax.tree_util.tree_leaves(trainer.params):
        total += x.nbytes
        held += sum(s.data.nbytes for s in x.addressable_shards if s.device == device)
    return held / (total / N)


def measure(name):
    batch = collate(examples(PER_DEVICE * 8 // N))
    trainer = trainer_for(name, BLOCKS)
    trainer.compile_train_step(batch)
    layer = per_layer(lambda depth: trainer_for(name, depth).compile_train_step(batch), trainer.mesh,
                      depths=(1, 2))
    ideal = megatron_conv_ideal(block_activations(PER_DEVICE), N)
    mp = layer.get("mp", {"count": 0, "wire_bytes": 0})
    return trainer.layout.name, device0_share(trainer), mp["count"], ideal["count"], mp["wire_bytes"] / ideal["wire_bytes"]


def main(names):
    print(f"{'CNN':<8}{'layout':<34}{'device-0 share':>15}{'mp collectives/block':>22}{'mp bytes / Megatron':>21}")
    t0 = time.perf_counter()
    for name in names:
        layout, share, count, ideal, ratio = measure(name)
        print(f"{name:<8}{layout:<34}{share:>14.2f}x{count:>12g} (ideal {ideal}){ratio:>20.3f}x", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s; jax {jax.__version__}, {jax.device_count()} CPU devices, "
          f"{BLOCKS} blocks per stage, per-block figures for one block of each stage)")


if __name__ == "__main__":
    main(sys.argv[1:] or list(CNNS))
