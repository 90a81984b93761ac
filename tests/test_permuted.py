"""Fused 2-D projections (GPT-2's c_attn, a fused gate/up) stored permuted so they split by heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from architectures import B, F, H, NH, T, V, _Init, _tokens, attend, cross_entropy, gpt2, merge, rms_norm
from redcoast.layout.comms import megatron_ideal, per_layer
from redcoast.errors import ConfigError
from redcoast.sharding.dataflow import dataflow_placements
from redcoast.sharding.grouped_axes import named_sharding
from redcoast.sharding.paths import path_to_tuple
from redcoast.sharding.permuted import (Permutation, find_fused_projections, permuted_placements,
                                        state_permutations, storage_loss, to_storage, to_user)

N = 4  # model shards: 8 simulated devices as dp 2 x mp 4


def fused_lm(n_layers=2, seed=0, heads=NH, remat=False, also_whole=False):
    """Hugging Face Flax GPT-2's layout: c_attn kernel (3*hidden, hidden) applied transposed,
    Q/K/V cut with jnp.split; the MLP a Llama port's fused gate/up (hidden, 2*ffn) cut in two.
    Layers run under jax.jit (and jax.checkpoint with ``remat``). ``also_whole``: the fused
    Q/K/V output is also read whole (a penalty on it), so it cannot be stored permuted."""
    w = _Init(seed)
    params = {"emb": w(V, H), "layers": [
        {"ln": w.ones(H), "c_attn": {"kernel": w(3 * H, H), "bias": w(3 * H, scale=0.05)},
         "o": w(H, H), "ln2": w.ones(H), "gate_up": w(H, 2 * F), "down": w(F, H)}
        for _ in range(n_layers)], "ln_f": w.ones(H)}

    def split_heads(x):
        return x.reshape(x.shape[:-1] + (heads, H // heads))

    def layer(lyr, h):
        x = rms_norm(h, lyr["ln"])
        qkv = jax.lax.dot_general(x, lyr["c_attn"]["kernel"], (((2,), (1,)), ((), ()))) + lyr["c_attn"]["bias"]
        q, k, v = jnp.split(qkv, 3, axis=2)
        h = h + merge(attend(split_heads(q), split_heads(k), split_heads(v))) @ lyr["o"]
        g, u = jnp.split(rms_norm(h, lyr["ln2"]) @ lyr["gate_up"], 2, axis=-1)
        h = h + (jax.nn.silu(g) * u) @ lyr["down"]
        return h, (jnp.mean(qkv ** 2) if also_whole else 0.0)

    run = jax.jit(jax.checkpoint(layer) if remat else layer)

    def loss(p, batch):
        h, extra = p["emb"][batch["inputs"]], 0.0
        for lyr in p["layers"]:
            h, penalty = run(lyr, h)
            extra = extra + penalty
        return cross_entropy(rms_norm(h, p["ln_f"]) @ p["emb"].T, batch["targets"]) + 1e-3 * extra

    return params, loss, _tokens()


def _specs(placements):
    return {"/".join(pl.path): pl.spec for pl in placements}


def _close(a, b):
    # float32 summation order only: the input gradient of the fused matmul sums over its output
    # axis, which the stored layout visits in another order
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def _gpt2():
    arch = gpt2(n_layers=1)
    return arch.params, arch.loss, arch.batch


@pytest.mark.parametrize("make", [_gpt2, lambda: fused_lm(1), lambda: fused_lm(1, remat=True)],
                         ids=["gpt2-conv1d", "hf-transposed-and-gate-up", "under-remat"])
def test_the_rewritten_loss_on_stored_params_is_the_loss_on_the_users(make):
    params, loss, batch = make()
    perms = find_fused_projections(loss, params, batch, n_model_shards=N)
    assert perms  # else this compares a function with itself
    stored = to_storage(params, perms)
    rewritten = storage_loss(loss, perms)
    value, grads = jax.jit(jax.value_and_grad(loss))(params, batch)
    value_s, grads_s = jax.jit(jax.value_and_grad(rewritten))(stored, batch)
    np.testing.assert_allclose(value_s, value, rtol=1e-6)
    _close(to_user(grads_s, perms), grads)


def test_the_stored_layout_is_each_shards_slice_of_every_part_and_round_trips_bitwise():
    params, loss, batch = fused_lm()
    perms = find_fused_projections(loss, params, batch, n_model_shards=N)
    kernel = params["layers"][0]["c_attn"]["kernel"]  # (3H, H): Q, K, V rows in three blocks
    assert perms[("layers", "0", "c_attn", "kernel")] == Permutation(axis=0, parts=3, shards=N)
    assert perms[("layers", "0", "gate_up")] == Permutation(axis=1, parts=2, shards=N)
    stored = to_storage(params, perms)
    block = 3 * H // N  # shard 1's rows: its H/N rows of Q, then of K, then of V
    want = np.concatenate([kernel[part * H + H // N:part * H + 2 * H // N] for part in range(3)])
    np.testing.assert_array_equal(np.asarray(stored["layers"][0]["c_attn"]["kernel"][block:2 * block]), want)
    back = jax.jit(lambda p: to_user(p, perms))(jax.jit(lambda p: to_storage(p, perms))(params))
    for x, y in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        assert x.shape == y.shape and np.array_equal(np.asarray(x), y)


def test_the_plan_of_the_rewritten_loss_splits_fused_projections_by_heads():
    params, loss, batch = fused_lm()
    before = _specs(dataflow_placements(loss, params, batch, n_model_shards=N))
    placements, perms = permuted_placements(loss, params, batch, n_model_shards=N)
    after = _specs(placements)
    assert before["layers/0/c_attn/kernel"] == P() and before["layers/0/gate_up"] == P()
    assert after["layers/0/c_attn/kernel"] == P("mp") and after["layers/0/c_attn/bias"] == P("mp")
    assert after["layers/0/gate_up"] == P(None, "mp") and after["layers/0/down"] == P("mp")
    assert after["layers/0/o"] == P("mp")
    assert set(perms) == {("layers", str(i), *leaf) for i in range(2)
                          for leaf in (("c_attn", "kernel"), ("c_attn", "bias"), ("gate_up",))}
    gpt2_specs = _specs(permuted_placements(gpt2().loss, gpt2().params, gpt2().batch, n_model_shards=N)[0])
    assert gpt2_specs["h/0/attn/c_attn/weight"] == P(None, "mp") and gpt2_specs["h/0/attn/c_attn/bias"] == P("mp")
    assert gpt2_specs["h/0/attn/c_proj/weight"] == P("mp")


def test_a_fused_output_also_read_whole_stays_as_written():
    params, loss, batch = fused_lm(also_whole=True)
    perms = find_fused_projections(loss, params, batch, n_model_shards=N)
    assert ("layers", "0", "c_attn", "kernel") not in perms and ("layers", "0", "c_attn", "bias") not in perms
    assert ("layers", "0", "gate_up") in perms  # the MLP's fused gate/up is still only cut
    assert _specs(permuted_placements(loss, params, batch, n_model_shards=N)[0])["layers/0/c_attn/kernel"] == P()
    # a layout chosen for another program is refused when run, never run slowly
    clean = find_fused_projections(fused_lm()[1], params, batch, n_model_shards=N)
    with pytest.raises(ConfigError, match="permuted"):
        storage_loss(loss, clean)(to_storage(params, clean), batch)


def test_parts_whose_heads_do_not_divide_the_shards_are_not_permuted():
    params, loss, batch = fused_lm(heads=2)  # 2 heads per part on 4 shards: the plan cannot split them
    assert ("layers", "0", "c_attn", "kernel") in find_fused_projections(loss, params, batch, n_model_shards=N)
    placements, perms = permuted_placements(loss, params, batch, n_model_shards=N)
    assert ("layers", "0", "c_attn", "kernel") not in perms and _specs(placements)["layers/0/c_attn/kernel"] == P()
    assert ("layers", "0", "gate_up") in perms


def _megatron_share(params):
    """Bytes on one device under Megatron-LM's hand-written GPT-2 plan on N shards: c_attn and
    c_fc (kernel, bias) split by columns, both c_proj kernels by rows, the vocabulary split;
    layer norms, row-parallel biases and position embeddings replicated."""
    total = 0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = "/".join(path_to_tuple(path))
        split = any(s in name for s in ("c_attn", "c_fc", "c_proj/weight", "wte"))
        total += x.nbytes // (N if split else 1)
    return total


def test_gpt2_step_moves_megatron_bytes_and_holds_its_share_of_the_parameters():
    mesh = jax.make_mesh((8 // N, N), ("dp", "mp"), axis_types=(AxisType.Auto,) * 2)
    held = {}

    def compiled(depth):
        arch = gpt2(n_layers=depth)
        placements, perms = permuted_placements(arch.loss, arch.params, arch.batch, n_model_shards=N)
        by_path = {pl.path: pl.spec for pl in placements}
        shardings = jax.tree_util.tree_map_with_path(
            lambda kp, _: named_sharding(mesh, by_path[path_to_tuple(kp)]), arch.params)
        stored = jax.jit(lambda p: to_storage(p, perms), out_shardings=shardings)(arch.params)
        held[depth] = (sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(stored)),
                       sum(x.nbytes for x in jax.tree_util.tree_leaves(stored)), _megatron_share(arch.params))
        loss = storage_loss(arch.loss, perms)

        def step(p, batch):
            return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, p, jax.grad(loss)(p, batch))
        return jax.jit(step, in_shardings=(shardings, NamedSharding(mesh, P("dp"))),
                       out_shardings=shardings).lower(stored, arch.batch).compile()

    layer = per_layer(compiled, mesh, depths=(1, 2))
    ideal = megatron_ideal(B // (8 // N), T, H, N)
    assert layer["mp"]["wire_bytes"] / ideal["wire_bytes"] <= 1.05  # 2.4x as written (issue 13)
    (dev1, total1, _), (dev2, total2, mega2) = held[1], held[2]
    assert (dev2 - dev1) / ((total2 - total1) / N) <= 1.10  # one layer: 1.07 (its norms, c_proj bias)
    assert dev2 <= 1.10 * mega2  # the whole model against Megatron's own placement


def test_optimizer_state_that_follows_a_permuted_parameter_is_permuted_alike():
    import optax
    params, loss, batch = fused_lm(1)
    perms = find_fused_projections(loss, params, batch, n_model_shards=N)
    kernel = ("layers", "0", "c_attn", "kernel")
    adam = state_permutations(optax.adam(1e-3).init(params), params, perms)
    assert {p[1:] for p in adam} == {(m, *path) for m in ("mu", "nu") for path in perms}
    assert all(adam[p] == perms[p[2:]] for p in adam)
    # adafactor: the column statistics keep the permuted axis (3*hidden), the row ones do not
    fact = state_permutations(optax.adafactor(1e-3, min_dim_size_to_factor=8).init(params), params, perms)
    assert fact[("0", "v_col", *kernel)] == Permutation(axis=0, parts=3, shards=N)
    assert not any(p[1] == "v_row" for p in fact)


def test_training_in_the_stored_layout_follows_training_as_written():
    # three steps of SGD with momentum of the Trainer-style loss on stored params and optimizer
    # state, mapped back, against the same steps as written (not Adam: the key bias has a zero
    # true gradient, whose rounding noise Adam would turn into lr-sized steps, see NOTES.md)
    import optax
    from redcoast.sharding.permuted import convert_state, storage_loss_fn
    from redcoast.train_state import TrainState

    params, loss, batch = fused_lm(1)
    perms = find_fused_projections(loss, params, batch, n_model_shards=N)
    user_loss = lambda rng, state, p, b, is_training: loss(p, b) if is_training else None  # noqa: E731
    tx = optax.sgd(0.1, momentum=0.9)

    def run(loss_fn, state):
        step = jax.jit(lambda s: s.apply_gradients(
            grads=jax.grad(lambda p: loss_fn(None, s, p, batch, True))(s.params)))
        for _ in range(3):
            state = step(state)
        return state

    start = TrainState(step=jnp.array(0), params=params, opt_state=tx.init(params), nonfinite_step=jnp.array(-1),
                       apply_fn=None, tx=tx)
    want = run(user_loss, start)
    got = convert_state(run(storage_loss_fn(user_loss, perms), convert_state(start, perms, to_storage)),
                        perms, to_user)
    _close(got.params, want.params)
    _close(got.opt_state, want.opt_state)


# ---- through the Trainer -------------------------------------------------------------------------
def _stack(rows):
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _gpt2_trainer(depth, n, workdir=None):
    import optax
    from redcoast import Deployer, Trainer
    arch = gpt2(n_layers=depth)
    deployer = Deployer(jax_seed=0, n_model_shards=n, workdir=workdir, verbose=False)
    trainer = Trainer(deployer, _stack, None, lambda rng, state, params, batch, is_training: arch.loss(params, batch),
                      arch.params, optax.sgd(0.1, momentum=0.9), fsdp=False, fuse_matmuls=True)
    return arch, trainer


def test_the_trainer_splits_gpt2s_fused_c_attn_by_heads_at_megatron_traffic():
    from redcoast import Deployer
    trainers = {}

    def compiled(depth):
        arch, trainers[depth] = _gpt2_trainer(depth, N)
        return trainers[depth].compile_train_step(arch.batch)

    layer = per_layer(compiled, Deployer(n_model_shards=N, verbose=False).mesh, depths=(1, 2))
    assert layer["mp"]["wire_bytes"] / megatron_ideal(B // (8 // N), T, H, N)["wire_bytes"] <= 1.05
    specs = _specs(trainers[2].plan.placements)
    assert specs["h/0/attn/c_attn/weight"] == P(None, "mp") and specs["h/0/attn/c_attn/bias"] == P("mp")
    held = {d: (sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(t.params)),
                sum(x.nbytes for x in jax.tree_util.tree_leaves(t.params))) for d, t in trainers.items()}
    assert (held[2][0] - held[1][0]) / ((held[2][1] - held[1][1]) / N) <= 1.10
    assert held[2][0] <= 1.10 * _megatron_share(gpt2(n_layers=2).params)
    # what the user sees is their own layout: before any step, the parameters as given
    for got, want in zip(jax.tree_util.tree_leaves(trainers[2].params), jax.tree_util.tree_leaves(gpt2(2).params)):
        assert got.shape == want.shape and np.array_equal(np.asarray(got), want)


@pytest.mark.slow  # two trainers compiled, a checkpoint written and restored: about 10 s of CPU
def test_the_trainer_presents_the_users_layout_in_params_checkpoints_and_exports(tmp_path):
    from redcoast.store.checkpoint import CheckpointStore
    from safetensors.numpy import load_file
    arch, sharded = _gpt2_trainer(1, N, str(tmp_path))
    rows = [{k: v[i] for k, v in arch.batch.items()} for i in range(B)]
    sharded.fit(rows * 2, B // 2, 1, shuffle=False, save_last_ckpt=True)  # 2 steps of the batch
    assert sharded.step == 2
    assert _specs(sharded.plan.placements)["h/0/attn/c_attn/weight"] == P(None, "mp")
    stored = sharded._state.params["h"]["0"]["attn"]["c_attn"]["weight"]  # as the step reads it
    assert not np.array_equal(np.asarray(stored), np.asarray(sharded.params["h"]["0"]["attn"]["c_attn"]["weight"]))
    import optax
    tx, want = optax.sgd(0.1, momentum=0.9), arch.params  # the same two steps, hand-written
    want_opt = tx.init(want)
    for _ in range(2):
        updates, want_opt = tx.update(jax.jit(jax.grad(arch.loss))(want, arch.batch), want_opt, want)
        want = optax.apply_updates(want, updates)
    _close(sharded.params, want)
    _close(sharded.state.opt_state, want_opt)
    sharded.save_params(str(tmp_path / "p.safetensors"))
    exported = load_file(str(tmp_path / "p.safetensors"))
    np.testing.assert_array_equal(exported["h.0.attn.c_attn.weight"],
                                  np.asarray(sharded.params["h"]["0"]["attn"]["c_attn"]["weight"]))
    _, restorer = _gpt2_trainer(1, 1)
    restorer.restore_checkpoint(CheckpointStore(tmp_path / "checkpoints" / "steps"))
    for got, want in zip(jax.tree_util.tree_leaves((restorer.params, restorer.state.opt_state)),
                         jax.tree_util.tree_leaves((sharded.params, sharded.state.opt_state))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # and back onto the permuted layout: a set_params round trip keeps the values
    sharded.set_params(restorer.params, reset_opt_state=False)
    for got, want in zip(jax.tree_util.tree_leaves(sharded.params), jax.tree_util.tree_leaves(restorer.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_failing_permutation_analysis_leaves_the_plan_as_written(monkeypatch):
    import redcoast.sharding.permuted as permuted

    def broken(*args, **kwargs):
        raise NotImplementedError("an op the walk does not know")

    arch = gpt2(n_layers=1)
    monkeypatch.setattr(permuted, "find_fused_projections", broken)
    placements, source, perms = permuted.traced_permuted_placements(arch.loss, arch.params, arch.batch,
                                                                    n_model_shards=N)
    assert perms == {} and "an op the walk does not know" in source
    assert _specs(placements) == _specs(dataflow_placements(arch.loss, arch.params, arch.batch, n_model_shards=N))
