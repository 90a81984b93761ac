"""The structural tensor-parallel plan, user rules, and their validation."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from redcoast import ConfigError, Deployer
from redcoast.sharding import first_matching_rule


def zeros(*shape):
    return np.zeros(shape, np.float32)


def flax_style_layer(width=64, ffn=256, vocab=1000, heads=None):
    """Params as Flax Linen writes them: (in, out) kernels, modules in forward order."""
    if heads:
        head_dim = width // heads
        attn = {"query": {"kernel": zeros(width, heads, head_dim), "bias": zeros(heads, head_dim)},
                "key": {"kernel": zeros(width, heads, head_dim), "bias": zeros(heads, head_dim)},
                "value": {"kernel": zeros(width, heads, head_dim), "bias": zeros(heads, head_dim)},
                "out": {"kernel": zeros(heads, head_dim, width), "bias": zeros(width)}}
    else:
        attn = {name: {"kernel": zeros(width, width), "bias": zeros(width)}
                for name in ("q_a", "k_b", "v_c", "o_d")}  # meaningless but ordered names
    return {
        "wte": {"embedding": zeros(vocab, width)},
        "layer_0": {"ln_1": {"scale": zeros(width)}, "attn": attn, "ln_2": {"scale": zeros(width)},
                    "mlp": {"fc_a": {"kernel": zeros(width, ffn), "bias": zeros(ffn)},
                            "fc_b": {"kernel": zeros(ffn, width), "bias": zeros(width)}}},
        "lm_head": {"kernel": zeros(width, vocab)},
    }


@pytest.fixture(scope="module")
def deployer():
    return Deployer(n_model_shards=4, verbose=False)


def specs_of(plan):
    return {"/".join(pl.path): pl.spec for pl in plan.placements}


def test_paper_rules_on_a_flax_layer_with_2d_attention(deployer):
    specs = specs_of(deployer.get_sharding_plan(flax_style_layer()))
    attn = "layer_0/attn/"
    for name in ("q_a", "k_b", "v_c"):  # read the residual stream: split outputs
        assert specs[attn + name + "/kernel"] == P(None, "mp")
        assert specs[attn + name + "/bias"] == P("mp")
    assert specs[attn + "o_d/kernel"] == P("mp")  # writes it back: split inputs
    assert specs[attn + "o_d/bias"] == P()
    assert specs["layer_0/mlp/fc_a/kernel"] == P(None, "mp")
    assert specs["layer_0/mlp/fc_a/bias"] == P("mp")
    assert specs["layer_0/mlp/fc_b/kernel"] == P("mp")
    assert specs["layer_0/mlp/fc_b/bias"] == P()
    assert specs["layer_0/ln_1/scale"] == P()
    assert specs["wte/embedding"] == P("mp")  # vocabulary axis
    assert specs["lm_head/kernel"] == P(None, "mp")


def test_3d_attention_kernels_split_heads_never_head_dim(deployer):
    specs = specs_of(deployer.get_sharding_plan(flax_style_layer(heads=8)))
    assert specs["layer_0/attn/query/kernel"] == P(None, "mp")  # (width, heads, head_dim)
    assert specs["layer_0/attn/query/bias"] == P("mp")  # (heads, head_dim)
    assert specs["layer_0/attn/out/kernel"] == P("mp")  # (heads, head_dim, width)
    plan = deployer.get_sharding_plan(flax_style_layer(width=48, heads=6))  # 6 heads, 4 shards
    q = next(pl for pl in plan.placements if pl.path[-2:] == ("query", "kernel"))
    assert q.spec == P() and "not divisible" in q.reason


def test_pytorch_layout_kernels_split_the_inner_dimension(deployer):
    params = {"up": {"weight": zeros(256, 64)}, "down": {"weight": zeros(64, 256)},
              "norm": {"weight": zeros(64)}, "embed": {"weight": zeros(1000, 64)}}
    specs = specs_of(deployer.get_sharding_plan(params))
    assert specs["up/weight"] == P("mp")  # (out=ffn, in=hidden)
    assert specs["down/weight"] == P(None, "mp")  # (out=hidden, in=ffn)
    assert specs["norm/weight"] == P()


def test_dimensions_that_do_not_divide_are_replicated(deployer):
    params = flax_style_layer(width=64, ffn=250, vocab=1001)
    plan = deployer.get_sharding_plan(params)
    specs = specs_of(plan)
    assert specs["layer_0/mlp/fc_a/kernel"] == P()
    assert specs["layer_0/mlp/fc_a/bias"] == P()
    assert specs["wte/embedding"] == P(None, "mp")  # vocab 1001 does not divide: hidden does
    assert "not divisible" in plan.table()


def test_user_rules_override_and_printed_rules_round_trip(deployer):
    params = flax_style_layer()
    plan = deployer.get_sharding_plan(params)
    rules = deployer.get_sharding_rules(params)
    assert all(isinstance(r, tuple) and isinstance(s, P) for r, s in rules)
    again = deployer.get_sharding_plan(params, params_sharding_rules=rules)
    assert specs_of(again) == specs_of(plan)
    user = [(("mlp", "fc_a", "kernel"), P("mp", None)), (("lm_head", ".*"), P())]
    overridden = specs_of(deployer.get_sharding_plan(params, params_sharding_rules=user))
    assert overridden["layer_0/mlp/fc_a/kernel"] == P("mp")
    assert overridden["lm_head/kernel"] == P()
    assert overridden["layer_0/mlp/fc_b/kernel"] == P("mp")  # untouched: automatic


def test_rules_match_consecutive_path_entries():
    rules = [(("attn", "q.*", "kernel"), P(None, "mp")), ((".*",), P())]
    assert first_matching_rule(rules, ("params", "layer_0", "attn", "q_a", "kernel")) == P(None, "mp")
    assert first_matching_rule(rules, ("attn", "x", "q_a", "kernel")) == P()


def test_bad_user_rules_get_clear_errors(deployer):
    params = flax_style_layer(ffn=250)
    with pytest.raises(ConfigError, match=r"layer_0/mlp/fc_a/kernel.*250.*does not divide"):
        deployer.get_sharding_plan(params, [(("fc_a", "kernel"), P(None, "mp"))])
    with pytest.raises(ConfigError, match="not a \\(tuple of regexes, PartitionSpec\\)"):
        deployer.get_sharding_plan(params, [("fc_a", "mp")])
    with pytest.raises(ConfigError, match="names mesh axis 'model'"):
        deployer.get_sharding_plan(params, [(("fc_a", "kernel"), P(None, "model"))])
    with pytest.raises(ConfigError, match="has 3 entries"):
        deployer.get_sharding_plan(params, [(("fc_a", "kernel"), P(None, None, "mp"))])


def test_plan_table_reports_bytes_per_device(deployer):
    params = {"a": {"kernel": zeros(64, 256)}, "b": {"kernel": zeros(256, 64)}}
    table = deployer.get_sharding_plan(params).table()
    assert f"parameter bytes per device: {2 * 64 * 256 * 4 // 4:,}" in table
