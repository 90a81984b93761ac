"""A training run that saves often, for the kill / SIGTERM tests of test_checkpoint.py.

    python ckpt_worker.py WORKDIR OUT.npz [SLOW_STEP_SECONDS]

Runs 3 epochs of 12 updates, checkpointing every 3 updates and keeping the best by eval loss;
writes the final parameters to OUT.npz. Run again with the same WORKDIR, it resumes. The layout
is fixed (fsdp off, fusion on), so each of the tests' many processes compiles one step rather
than comparing candidates (what is killed and resumed is the same either way).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from redcoast.simulate import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from redcoast import Deployer, Trainer  # noqa: E402
from redcoast.export import flat_tensors  # noqa: E402
from tiny_lm import collate_fn, loss_fn, make_examples, make_model  # noqa: E402


def main():
    workdir, out = sys.argv[1], sys.argv[2]
    slow = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0

    def collate(examples):  # optionally slow, so a signal lands mid-training
        time.sleep(slow)
        return collate_fn(examples)

    model, params = make_model(dropout=0.1)
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    trainer = Trainer(deployer, collate, model.apply, loss_fn, params, optax.adamw(1e-2),
                      fsdp=False, fuse_matmuls=True)
    trainer.fit(make_examples(48), 1, 3, eval_examples=make_examples(6, seed=1),
                save_every_n_steps=3, keep_last_n_ckpts=3, save_argmin_ckpt_by_metrics=["loss"],
                log_every_n_steps=4)
    np.savez(out, **flat_tensors(trainer.params))
    print(f"finished at step {trainer.step}", flush=True)


if __name__ == "__main__":
    main()
