"""One process of a multi-process run on loopback, started by test_multiprocess.py.

    python multiprocess_worker.py OUT_DIR N_MODEL_SHARDS[,N_MODEL_SHARDS...] \
        [PROCESS_ID N_PROCESSES PORT N_LOCAL_DEVICES]
    python multiprocess_worker.py OUT_DIR ckpt
    python multiprocess_worker.py OUT_DIR gqa
    python multiprocess_worker.py OUT_DIR nan
    python multiprocess_worker.py OUT_DIR moves
    python multiprocess_worker.py OUT_DIR merge
    python multiprocess_worker.py OUT_DIR lead

With the last four arguments the Deployer gets them explicitly; without them it finds its place
in the run by itself (under ``redcoast launch``: from the REDCOAST_* variables). One run of
``run_tiny.run`` per number of model shards, all in the same processes; each process saves its
results, and how many examples it collated, to OUT_DIR/process_{id}_mp{n}.npz.

``gqa``: train tests/architectures.py's gqa (2 KV heads) on 4 model shards with the matmul
fusion on, so its K/V are kept by groups of shards ('mp:2'); save the parameters and K's spec to
OUT_DIR/gqa_{id}.npz.

``nan``: train on labels of -100 (a NaN loss at step 0) and write the NonFiniteLossError's
message to OUT_DIR/nan_{id}.txt.

``moves``: move 40 arrays spread over both processes between two device orders 30 times with
``redcoast.multihost.placement.device_put``, and write their sums to OUT_DIR/moves_{id}.npz.

``merge``: train LoRA adapters with FSDP on 2 model shards (the adapters sharded over both
processes), then merge them into the base outside the step 20 times; write the base, the
adapters, the merged parameters and the merged kernels' specs to OUT_DIR/merge_{id}.npz.

``lead``: train 200 updates reading the metrics once, then evaluate 40 batches 6 times, each
read once at its end (the host far ahead of the devices); write the parameters and the
evaluations' losses to OUT_DIR/lead_{id}.npz.

``ckpt``: restore the checkpoint found in OUT_DIR/workdir (written by another number of
processes), save what was restored, train one more epoch from it, save a checkpoint there and
the final state (OUT_DIR/restored_{id}.npz, OUT_DIR/final_{id}.npz).
"""

import os
import sys

import numpy as np


CKPT_EXAMPLES, CKPT_SHARDS = 32, 2


def ckpt_trainer(workdir):
    """The trainer of the checkpoint round trip (the same on every number of processes)."""
    import optax
    from redcoast import Deployer, Trainer
    from tiny_lm import collate_fn, loss_fn, make_model

    deployer = Deployer(jax_seed=0, n_model_shards=CKPT_SHARDS, workdir=workdir, verbose=False)
    model, params = make_model()
    return Trainer(deployer, collate_fn, model.apply, loss_fn, params, optax.adamw(1e-2))


def flat_host(tree):
    """``tree``'s arrays, complete on every process, as numpy arrays by path ("['a']['b']")."""
    import jax
    from redcoast.multihost.host import to_host

    flat = jax.tree_util.tree_leaves_with_path(to_host(tree))
    return {jax.tree_util.keystr(p): x for p, x in flat}


def host_state(trainer):
    """The trainer's step, parameters and optimizer state as complete numpy arrays, by path."""
    return {"step": trainer.step,
            **flat_host({"params": trainer.params, "opt_state": trainer.state.opt_state})}


def checkpoint_round_trip(out_dir):
    import jax
    from redcoast.store.checkpoint import CheckpointStore
    from tiny_lm import make_examples

    workdir = os.path.join(out_dir, "workdir")
    trainer = ckpt_trainer(workdir)
    trainer.restore_checkpoint(CheckpointStore(os.path.join(workdir, "checkpoints", "steps")))
    np.savez(os.path.join(out_dir, f"restored_{jax.process_index()}.npz"), **host_state(trainer))
    trainer = ckpt_trainer(workdir)  # fit resumes from the same checkpoint by itself
    trainer.fit(make_examples(CKPT_EXAMPLES), 1, n_epochs=2, save_last_ckpt=True)
    np.savez(os.path.join(out_dir, f"final_{jax.process_index()}.npz"), **host_state(trainer))


def grouped_kv_run(out_dir):
    import jax
    import optax
    from architectures import gqa
    from redcoast import Deployer, Trainer

    arch = gqa(n_layers=1)
    rows = [{k: v[i] for k, v in arch.batch.items()} for i in range(len(arch.batch["inputs"]))] * 2
    trainer = Trainer(Deployer(jax_seed=0, n_model_shards=4, verbose=False),
                      lambda rs: {k: np.stack([r[k] for r in rs]) for k in rs[0]}, None,
                      lambda rng, state, params, batch, is_training: arch.loss(params, batch),
                      arch.params, optax.sgd(0.1, momentum=0.9), fuse_matmuls=True)
    trainer.fit(rows, 4, n_epochs=1)
    state = host_state(trainer)
    state["k_spec"] = np.array(str(trainer.params["layers"][0]["k"].sharding.spec))
    np.savez(os.path.join(out_dir, f"gqa_{jax.process_index()}.npz"), **state)
    return state


def nan_run(out_dir):
    import jax
    import optax
    from redcoast import Deployer, NonFiniteLossError, Trainer
    from tiny_lm import ignore_index_collate, make_examples, make_model, masked_loss

    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)  # before any JAX call
    model, params = make_model()
    trainer = Trainer(deployer, ignore_index_collate, model.apply, masked_loss, params,
                      optax.adamw(1e-2))
    try:
        trainer.train(make_examples(16), 1)
        message = "no error"
    except NonFiniteLossError as e:
        message = str(e)
    with open(os.path.join(out_dir, f"nan_{jax.process_index()}.txt"), "w") as f:
        f.write(message)


def moves_run(out_dir, rounds=30):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from redcoast import Deployer
    from redcoast.multihost import placement
    from redcoast.multihost.host import to_host

    Deployer(jax_seed=0, verbose=False)  # joins the run (before any JAX call)
    devices = np.array(jax.devices())
    ordered = Mesh(devices.reshape(4, 2), ("dp", "mp"))
    crossed = Mesh(devices.reshape(2, 4).T.reshape(4, 2), ("dp", "mp"))  # mp pairs span processes
    values = [np.arange(8 * (i % 3 + 1) * 16, dtype=np.float32).reshape(-1, 16) + i
              for i in range(40)]
    tree = {f"w{i}": jax.make_array_from_callback(x.shape, NamedSharding(ordered, P("dp", "mp")),
                                                  lambda index, x=x: x[index])
            for i, x in enumerate(values)}
    for r in range(rounds):
        mesh = crossed if r % 2 == 0 else ordered
        spec = P("mp", "dp") if r % 3 else P("dp", "mp")
        tree = placement.device_put(tree, NamedSharding(mesh, spec), donate=r % 2 == 1)
    np.savez(os.path.join(out_dir, f"moves_{jax.process_index()}.npz"), **to_host(tree))


def merge_run(out_dir, rounds=20):
    import jax
    import optax
    from redcoast import Deployer, LoRA, Trainer
    from tiny_lm import collate_fn, loss_fn, make_examples, make_model

    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)  # before any JAX call
    model, base = make_model()
    lora = LoRA(rank=4, alpha=8, targets=r"kernel$")

    def lora_loss(rng, state, params, batch, is_training):
        return loss_fn(rng, state, lora.merge(state.frozen_params, params), batch, is_training)
    trainer = Trainer(deployer, collate_fn, model.apply, lora_loss, lora.init(base),
                      optax.adam(3e-2), frozen_params=base, fsdp=True)
    trainer.train(make_examples(16), 1)
    for _ in range(rounds):  # as a user exports: outside any jitted function
        merged = lora.merge(trainer.frozen_params, trainer.params)
    specs = {f"spec{jax.tree_util.keystr(p)}": np.array(str(x.sharding.spec))
             for p, x in jax.tree_util.tree_leaves_with_path(
                 {"merged": merged, "base": trainer.frozen_params})}
    np.savez(os.path.join(out_dir, f"merge_{jax.process_index()}.npz"), **specs, **flat_host(
        {"base": trainer.frozen_params, "adapters": trainer.params, "merged": merged}))


def lead_run(out_dir):
    import jax
    import optax
    from redcoast import Deployer, Trainer
    from tiny_lm import collate_fn, loss_fn, make_examples, make_model

    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False)  # before any JAX call
    model, params = make_model()
    trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params, optax.sgd(0.05))
    trainer.train(make_examples(4 * 200), 1, log_every_n_steps=200)  # 4 data shards
    losses = [trainer.eval_loss(make_examples(160, seed=1), 1) for _ in range(6)]
    np.savez(os.path.join(out_dir, f"lead_{jax.process_index()}.npz"), eval_losses=losses,
             **host_state(trainer))


MODES = {"ckpt": checkpoint_round_trip, "gqa": grouped_kv_run, "nan": nan_run, "moves": moves_run,
         "merge": merge_run, "lead": lead_run}


def main():
    out_dir = sys.argv[1]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if sys.argv[2] in MODES:
        return MODES[sys.argv[2]](out_dir)
    shard_counts = [int(n) for n in sys.argv[2].split(",")]
    explicit = {}
    if len(sys.argv) > 3:
        process_id, n_processes, port, n_local = map(int, sys.argv[3:7])
        explicit = dict(n_processes=n_processes, host0_address="127.0.0.1", host0_port=port,
                        process_id=process_id, n_local_devices=n_local)
    import jax
    import run_tiny
    from redcoast import Deployer

    collated = []
    collate = run_tiny.collate_fn

    def counting_collate(examples):  # run() looks collate_fn up in its module at call time
        collated.append(len(examples))
        return collate(examples)

    run_tiny.collate_fn = counting_collate
    for n_model_shards in shard_counts:
        collated.clear()
        workdir = os.path.join(out_dir, f"workdir_mp{n_model_shards}")
        deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, workdir=workdir,
                            verbose=not explicit, **explicit)
        result = run_tiny.run(deployer)
        result["rows_collated"] = np.array(sum(collated))
        result["process_index"] = np.array(jax.process_index())
        deployer.logger.close()
        np.savez(os.path.join(out_dir, f"process_{jax.process_index()}_mp{n_model_shards}.npz"),
                 **result)
    print(f"worker {jax.process_index()} finished", flush=True)


if __name__ == "__main__":
    main()
