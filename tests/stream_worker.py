"""A run on a generator of examples, for the kill-and-resume test of test_streaming.py.

    python stream_worker.py WORKDIR OUT.npz [SLOW_STEP_SECONDS [PROCESS_ID N_PROCESSES PORT N_LOCAL]]

Trains a noisy linear regression for 2 epochs on ``stream(epoch)``, a generator of 44 examples
(5 updates of 8 and 4 left over per epoch), checkpointing every 2 updates; writes the final
parameters, and how many rows each collate_fn call got, to OUT.npz. Run again with the same
WORKDIR, it resumes. With the last four arguments it is one process of a multi-process run.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

W_TRUE = [1.0, -2.0, 0.5, 3.0]
PER_EPOCH = 44


def stream(epoch):
    """Each epoch's examples, generated in order and never held as a list."""
    import numpy as np
    rng = np.random.RandomState(epoch)
    for _ in range(PER_EPOCH):
        x = rng.normal(size=4).astype(np.float32)
        yield {"x": x, "y": np.float32(x @ np.asarray(W_TRUE, np.float32))}


def noisy_mse(rng, state, params, batch, is_training):
    import jax
    import jax.numpy as jnp
    pred = batch["x"] @ params["w"] + params["b"]
    noise = 0.1 * jax.random.normal(rng, pred.shape[:1]) if is_training else 0.0  # uses the rng
    return jnp.mean((pred[:, 0] + noise - batch["y"]) ** 2)


def train(workdir, slow=0.0, deployer_kwargs=None, collated=None, **fit_kwargs):
    """The trainer after ``fit`` on ``stream`` (a function of the epoch) in ``workdir``; the
    number of rows of each collate_fn call is appended to ``collated``."""
    import numpy as np
    import optax
    from redcoast import Deployer, Trainer

    def collate(rows):  # optionally slow, so a kill lands mid-epoch
        time.sleep(slow)
        if collated is not None:
            collated.append(len(rows))
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    deployer = Deployer(jax_seed=0, workdir=str(workdir), verbose=False, **(deployer_kwargs or {}))
    params = {"w": np.zeros((4, 1), np.float32), "b": np.zeros((1,), np.float32)}
    trainer = Trainer(deployer, collate, None, noisy_mse, params, optax.adam(0.05))
    kwargs = dict(save_every_n_steps=2, log_every_n_steps=2)
    kwargs.update(fit_kwargs)
    trainer.fit(stream, per_device_batch_size=1, n_epochs=2, **kwargs)
    return trainer


def main():
    workdir, out = sys.argv[1], sys.argv[2]
    slow = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    explicit = {}
    if len(sys.argv) > 4:
        process_id, n_processes, port, n_local = map(int, sys.argv[4:8])
        explicit = dict(n_processes=n_processes, host0_address="127.0.0.1", host0_port=port,
                        process_id=process_id, n_local_devices=n_local)
    else:
        from redcoast.simulate import simulate_cpu_devices
        simulate_cpu_devices(8)
    import numpy as np
    from redcoast.export import flat_tensors
    from redcoast.multihost.host import to_host
    collated = []
    trainer = train(workdir, slow, deployer_kwargs=explicit, collated=collated)
    np.savez(out, collated=np.array(collated), **flat_tensors(to_host(trainer.params)))
    print(f"finished at step {trainer.step}", flush=True)


if __name__ == "__main__":
    main()
