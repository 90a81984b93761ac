"""The data-flow analysis on this JAX: what it reads of JAX's internals, and no fallback.

Run on every JAX CI installs (0.10, 0.11, the newest): the analysis reads jaxpr equations, whose
parameters change between releases. These tests fail loudly when they do.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from redcoast import Deployer, Trainer
from redcoast.models import Model, bart, bert, gpt2, gptj, llama, opt, t5, vit
from redcoast.sharding import dataflow
from redcoast.sharding.dataflow import FALLBACK, DataflowError, traced_placements
from redcoast.sharding.interpreter import scan_operand_groups

from architectures import ARCHITECTURES


def test_scan_operand_groups_on_this_jax():
    def f(carry, xs, w, b):
        def body(c, x):
            return (c[0] + x[0] * w, c[1] + b), c[0] * x[1]
        return lax.scan(body, carry, xs)

    closed = jax.make_jaxpr(f)((1.0, 2.0), (jnp.ones(3), jnp.ones(3)), 2.0, 3.0)
    (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    assert scan_operand_groups(scan) == (2, 2, 2)  # consts w, b; carry of two; two scanned


def _model_cases():
    llama_config = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2)
    return {
        "llama": (llama, llama.LlamaForCausalLM, llama_config),
        "llama_remat": (llama, llama.LlamaForCausalLM, dataclasses.replace(llama_config, remat=True)),
        "gpt2": (gpt2, gpt2.GPT2LMHeadModel, gpt2.Config(vocab_size=64, n_positions=16, n_embd=32,
                                                         n_layer=2, n_head=4)),
        "bert": (bert, bert.BertModel, bert.Config(vocab_size=64, hidden_size=32,
                                                   num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_size=64, max_position_embeddings=16)),
        "t5": (t5, t5.T5ForConditionalGeneration, t5.Config(vocab_size=64, d_model=32, d_kv=8,
                                                               d_ff=64, num_layers=2, num_heads=4)),
        "gptj": (gptj, gptj.GPTJForCausalLM, gptj.Config(vocab_size=64, n_positions=16, n_embd=32,
                                                          n_layer=2, n_head=4, rotary_dim=4)),
        "opt": (opt, opt.OPTForCausalLM, opt.Config(vocab_size=64, hidden_size=32,
                                                     num_hidden_layers=2, ffn_dim=64,
                                                     max_position_embeddings=16,
                                                     num_attention_heads=4)),
        "bart": (bart, bart.BartForConditionalGeneration, bart.Config(
            vocab_size=64, max_position_embeddings=16, d_model=32, encoder_layers=2,
            encoder_ffn_dim=64, encoder_attention_heads=4, decoder_layers=2, decoder_ffn_dim=64,
            decoder_attention_heads=4)),
        "vit": (vit, vit.ViTModel, vit.Config(hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=64,
                                               image_size=16, patch_size=4)),
    }


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_no_test_architecture_falls_back_to_the_shape_rules(name):
    arch = ARCHITECTURES[name]()
    placements, source = traced_placements(arch.loss, arch.params, arch.batch, n_model_shards=4)
    assert placements is not None, source


@pytest.mark.parametrize("name", sorted(_model_cases()))
def test_no_redcoast_model_falls_back_to_the_shape_rules(name):
    family, module_cls, config = _model_cases()[name]
    model = Model(module_cls, config)
    placements, source = traced_placements(model.apply, model.abstract_params(),
                                           *family.example_inputs(config, module_cls),
                                           n_model_shards=2)
    assert placements is not None, source


def test_a_fallback_names_the_operation_and_the_trainer_warns(monkeypatch, capsys):
    def broken(self, eqn, ins):
        raise KeyError("num_consts")  # as a JAX that renamed a parameter would

    monkeypatch.setitem(dataflow.RULES, "dot_general", broken)
    arch = ARCHITECTURES["plain_jax"]()
    with pytest.raises(DataflowError, match="could not follow the operation 'dot_general'"):
        dataflow.dataflow_placements(arch.loss, arch.params, arch.batch, n_model_shards=2)

    def loss_fn(rng, state, params, batch, is_training):
        return arch.loss(params, batch)

    trainer = Trainer(Deployer(jax_seed=0, n_model_shards=2, verbose=False),
                      lambda rows: {k: np.stack([r[k] for r in rows]) for k in rows[0]},
                      None, loss_fn, arch.params, optax.sgd(0.1))
    trainer.compile_train_step(arch.batch)
    err = capsys.readouterr().err  # said even with verbose=False
    assert f"sharding plan from {FALLBACK}" in err and "'dot_general'" in err


def test_an_einsum_that_contracts_nothing_is_a_dot_general_without_contracting_axes_on_this_jax():
    # the analysis reads such a dot_general as a broadcasting multiply (rotary embeddings
    # written as an einsum, tests/test_written_by_others.py); if JAX lowers it otherwise, that
    # reading no longer applies and the plan of those models needs a look
    closed = jax.make_jaxpr(lambda q, c: jnp.einsum("bslh,...sh->bslh", q, c))(
        jnp.ones((2, 3, 4, 6)), jnp.ones((3, 6)))
    (dot,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "dot_general"]
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    assert tuple(lc) == tuple(rc) == () and len(lb) == len(rb) == 2


def test_a_split_into_one_piece_is_a_split_of_one_size_on_this_jax():
    # the analysis passes a split of one output through whole ((q,) = jnp.split(x, 1, axis));
    # it reads the primitive's 'axis' and its outputs (tests/test_written_by_others.py)
    closed = jax.make_jaxpr(lambda x: jnp.split(x, 1, axis=2))(jnp.ones((2, 3, 8)))
    (split,) = closed.jaxpr.eqns
    assert split.primitive.name == "split" and split.params["axis"] == 2
    assert len(split.outvars) == 1 and tuple(split.params["sizes"]) == (8,)
