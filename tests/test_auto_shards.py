"""n_model_shards='auto': the fewest model shards whose compiled step fits the memory budget."""

import optax
import pytest

from redcoast import ConfigError, Deployer, Trainer
from tiny_lm import assert_trees_close, collate_fn, loss_fn, make_examples, make_model


def _fit(n_model_shards, budget=None):
    deployer = Deployer(n_model_shards=n_model_shards, memory_budget_bytes=budget, verbose=False)
    model, params = make_model()
    trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params, optax.sgd(0.1, momentum=0.9))
    trainer.fit(make_examples(16), per_device_batch_size=2, n_epochs=1)
    return deployer, trainer


@pytest.mark.slow  # 26 s; the default suite keeps the over-budget error of "auto"
def test_auto_picks_the_fewest_shards_that_fit_and_trains_like_that_choice():
    deployer, trainer = _fit("auto", budget=2**40)  # everything fits: one shard, no splitting
    assert deployer.n_model_shards == 1 and list(trainer.model_shard_memory) == [1]

    need = trainer.model_shard_memory[1]
    deployer, trainer = _fit("auto", budget=need - 1)  # one shard is 1 byte too many
    memory = trainer.model_shard_memory
    chosen = deployer.n_model_shards
    assert chosen > 1 and memory[chosen] <= need - 1 < memory[1]
    assert all(memory[n] > need - 1 for n in memory if n < chosen)
    _, fixed = _fit(chosen)  # the same run with that number given explicitly
    assert_trees_close(trainer.params, fixed.params)


def test_auto_with_a_budget_nothing_meets_says_what_to_change():
    with pytest.raises(ConfigError, match="per_device_batch_size"):
        _fit("auto", budget=1)


def test_unknown_string_is_a_clear_error():
    with pytest.raises(ConfigError, match="'auto'"):
        Deployer(n_model_shards="max", verbose=False)
