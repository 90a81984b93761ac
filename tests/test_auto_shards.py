"""n_model_shards='auto': the shard count is a layout candidate, chosen by the cost model among those that fit."""

import optax
import pytest

from redcoast import ConfigError, Deployer, Trainer
from redcoast.layout.cost_model import TIE
from tiny_lm import assert_trees_close, collate_fn, loss_fn, make_examples, make_model


def _fit(n_model_shards, budget=None, **layout):
    deployer = Deployer(n_model_shards=n_model_shards, memory_budget_bytes=budget, verbose=False)
    model, params = make_model()
    trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params, optax.sgd(0.1, momentum=0.9),
                      **layout)
    trainer.fit(make_examples(16), per_device_batch_size=2, n_epochs=1)
    return deployer, trainer


@pytest.mark.slow  # 30 s; the default suite keeps the over-budget error of "auto"
def test_auto_chooses_the_cheapest_shard_count_that_fits_and_trains_like_that_choice():
    deployer, trainer = _fit("auto", budget=2**40)
    layout = trainer.layout
    considered = dict(layout.considered)
    assert {c.n_model_shards for c in considered} >= {1, 2} and layout.candidate in considered
    cheapest = min(e.seconds_per_example for e in considered.values())
    assert considered[layout.candidate].seconds_per_example <= cheapest * (1 + TIE)
    assert f"mp={layout.n_model_shards}" in layout.table and "<- chosen" in layout.table
    # the deployer is not changed by what the trainer chose
    assert deployer.n_model_shards == 8 and deployer.n_model_shards_requested == "auto"
    _, fixed = _fit(layout.n_model_shards, fsdp=layout.fsdp, fuse_matmuls=layout.fuse_matmuls)
    assert_trees_close(trainer.params, fixed.params)

    # a budget one byte under every candidate on one shard: more shards, and what it chose fits
    one = max(e.memory_bytes for c, e in considered.items() if c.n_model_shards == 1)
    _, trainer = _fit("auto", budget=one - 1)
    assert trainer.layout.n_model_shards > 1 and trainer.layout.estimate.memory_bytes <= one - 1


def test_auto_with_a_budget_nothing_meets_says_what_to_change():
    with pytest.raises(ConfigError, match="per_device_batch_size"):
        _fit("auto", budget=1)


def test_unknown_string_is_a_clear_error():
    with pytest.raises(ConfigError, match="'auto'"):
        Deployer(n_model_shards="max", verbose=False)
