"""compute_dtype=bfloat16 with a model that multiplies in float32 anyway is said at the first batch
(redcoast/layout/precision.py): the run is correct, only as slow as float32 training."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from redcoast import Deployer, Trainer
from redcoast.models import Model, llama

TOLD = "compute_dtype=bfloat16 gives the loss bfloat16 parameters, but "


def _rows(n=8, width=16):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=width).astype(np.float32)} for _ in range(n)]


def _collate(rows):
    return {"x": np.stack([r["x"] for r in rows])}


def _train(loss, params, compute_dtype=jnp.bfloat16, rows=None, collate=_collate):
    trainer = Trainer(Deployer(n_model_shards=1, verbose=False), collate, None, loss, params,
                      optax.sgd(0.1), compute_dtype=compute_dtype)
    trainer.train(rows or _rows(), per_device_batch_size=1)
    return trainer


@pytest.mark.parametrize("upcast", ["big", "small", None])
def test_the_share_of_products_in_a_wider_dtype_decides(upcast, capsys):
    # 16x64 then 64x16 ("big"), then a 16x2 head ("small"). Upcasting the big pair puts 98% of
    # the FLOPs in float32 (said, with the share); the head alone 2% (a model keeping its
    # logits in float32 on purpose: not said); nothing upcast: not said
    rng = np.random.default_rng(1)
    params = {"up": rng.normal(size=(16, 64)).astype(np.float32) / 4,
              "down": rng.normal(size=(64, 16)).astype(np.float32) / 8,
              "head": rng.normal(size=(16, 2)).astype(np.float32)}

    def loss(rng, state, p, batch, is_training):
        x = batch["x"].astype(jnp.float32 if upcast == "big" else p["up"].dtype)
        up, down = ((p["up"].astype(jnp.float32), p["down"].astype(jnp.float32))
                    if upcast == "big" else (p["up"], p["down"]))
        h = jnp.tanh(x @ up) @ down
        head = p["head"].astype(jnp.float32) if upcast == "small" else p["head"]
        return jnp.mean((h.astype(head.dtype) @ head) ** 2)

    _train(loss, params)
    err = capsys.readouterr().err
    if upcast == "big":
        assert TOLD + "98% of its matrix-product FLOPs multiply wider operands" in err, err
        assert "build the model with dtype=jnp.bfloat16" in err
    else:
        assert TOLD not in err, err


def test_a_llama_left_at_float32_is_told_and_one_at_bfloat16_is_not(capsys):
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    rng = np.random.default_rng(2)
    rows = [{"ids": rng.integers(0, 64, 9).astype(np.int32)} for _ in range(8)]
    collate = lambda rows: {"ids": np.stack([r["ids"] for r in rows])}  # noqa: E731
    for dtype in (jnp.float32, jnp.bfloat16):
        model = Model(llama.LlamaForCausalLM, llama.LlamaConfig(**config, dtype=dtype))

        def loss(rng, state, params, batch, is_training):
            logits = model.apply(params, batch["ids"][:, :-1]).astype(jnp.float32)
            labels = batch["ids"][:, 1:]
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        _train(loss, model.init(0), rows=rows, collate=collate)
        err = capsys.readouterr().err
        assert (TOLD + "100% of its matrix-product FLOPs" in err) == (dtype == jnp.float32), err


def test_float32_compute_is_never_traced_for_it(monkeypatch, capsys):
    # the check costs a trace of the loss; a float32 run (nothing to tell) does not pay it
    from redcoast.layout import precision
    monkeypatch.setattr(precision, "jaxpr_flops", lambda *a, **k: pytest.fail("traced"))
    params = {"w": np.ones((16, 4), np.float32)}
    _train(lambda rng, state, p, batch, t: jnp.mean((batch["x"] @ p["w"]) ** 2), params,
           compute_dtype=jnp.float32)
    assert TOLD not in capsys.readouterr().err


@pytest.mark.parametrize("compute_dtype", [jnp.float32, jnp.bfloat16])
def test_the_first_batch_is_collated_once_however_often_the_layout_asks_for_it(compute_dtype):
    # the layout's choice and this check both trace on the first batch: collate_fn runs for it
    # once, then once an update (a user counting calls, or one with side effects, sees no extra)
    calls = []

    def collate(rows):
        calls.append(len(rows))
        return _collate(rows)
    params = {"w": np.ones((16, 4), np.float32)}
    trainer = _train(lambda rng, state, p, batch, t: jnp.mean((batch["x"] @ p["w"]) ** 2), params,
                     compute_dtype=compute_dtype, rows=_rows(16), collate=collate)
    assert len(calls) == 1 + trainer.step, calls
