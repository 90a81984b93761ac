"""The Sampler: completions from a Trainer's own sharded parameters, against direct calls of
``generate`` on the same parameters gathered to the host (one device, no Predictor)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redcoast
from redcoast.errors import ConfigError, DataError
from redcoast.text.logprobs import sequence_logprobs, token_logprobs
from redcoast.models import Model, llama
from redcoast.models.generate import generate, left_pad, split_completions
from redcoast.text.packing import pad_sequences
from redcoast.text.sampling import Sampler

PROMPTS = [[1, 17, 45, 9, 80, 33, 5], [1, 60, 72], [1, 88, 21, 54, 3]]
PAD, N_NEW, WIDTH = 95, 6, 8
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            initializer_range=0.15,  # sharp next-token distributions: no near-ties
            bos_token_id=1, eos_token_id=2)


def collate(rows):
    return {"input_ids": np.stack(rows)}


def loss_fn(rng, state, params, batch, is_training):
    ids = batch["input_ids"]
    logits = state.apply_fn(params, ids[:, :-1])
    return -jnp.mean(sequence_logprobs(logits, ids[:, 1:], jnp.ones(ids[:, 1:].shape)))


@pytest.fixture(scope="module")
def setup():
    """(model, trainer on 2 model x 4 data shards, its params gathered to the host, an EOS the
    greedy rows reach)."""
    model = Model(llama.LlamaForCausalLM, llama.LlamaConfig(**TINY))
    deployer = redcoast.Deployer(n_model_shards=2, verbose=False)
    trainer = redcoast.Trainer(deployer, collate, model.apply, loss_fn, model.init(0),
                               optax.sgd(0.0))
    host = jax.device_get(trainer.params)
    ids, mask = left_pad(PROMPTS, PAD, WIDTH)
    free = np.asarray(generate(model, host, ids, mask, max_new_tokens=N_NEW, eos_token_id=()))
    return model, trainer, host, int(free[1, 2])  # the second prompt stops after 3 tokens


def direct(model, params, prompts, **options):
    ids, mask = left_pad(prompts, PAD, WIDTH)
    return np.asarray(generate(model, params, ids, mask, max_new_tokens=N_NEW, pad_token_id=PAD,
                               **options))


def test_greedy_completions_are_generates_tokens_up_to_eos(setup):
    model, trainer, host, eos = setup
    sampler = Sampler(trainer.deployer, model, max_new_tokens=N_NEW, prompt_len=WIDTH,
                      do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    specs = [x.sharding.spec for x in jax.tree_util.tree_leaves(trainer.params)]
    assert any("mp" in tuple(s) for s in specs)  # split over the model shards, used there
    got = sampler.sample(PROMPTS, trainer.params, per_device_batch_size=1, n=2)
    expected = split_completions(direct(model, host, PROMPTS, eos_token_id=eos), eos)
    assert got == [c for c in expected for _ in range(2)]  # each prompt's two, together
    assert got[2] == got[3] and got[2][-1] == eos and len(got[2]) == 3
    assert all(len(c) == N_NEW for i, c in enumerate(got) if i // 2 != 1)  # no EOS: all tokens


def test_samples_are_generates_with_the_key_the_predictor_folds(setup):
    model, trainer, host, _ = setup
    sampler = Sampler(trainer.deployer, model, max_new_tokens=N_NEW, prompt_len=WIDTH,
                      temperature=2.0, eos_token_id=(), pad_token_id=PAD)
    key = jax.random.key(3)
    # 3 prompts x 2 = 6 rows, one batch of 4 data shards x 2: the batch's key is fold_in(key, 0)
    got = sampler.sample(PROMPTS, trainer.params, 2, n=2, rng=key)
    rows = [p for p in PROMPTS for _ in range(2)]
    expected = direct(model, host, rows, do_sample=True, temperature=2.0, top_k=0, top_p=1.0,
                      eos_token_id=(), rng=jax.random.fold_in(key, 0))
    assert got == expected.tolist()
    assert got[0] != got[1]  # each row its own random stream
    assert sampler.sample(PROMPTS, trainer.params, 2, n=2, rng=key) == got
    assert sampler.sample(PROMPTS, trainer.params, 2, n=2) != got  # a fresh key per call


def test_lora_adapters_are_merged_with_the_base_in_the_step(setup):
    model, trainer, host, eos = setup
    lora = redcoast.LoRA(rank=2, alpha=4.0)
    adapters = jax.tree_util.tree_map(  # B away from zero, so that the adapters change tokens
        lambda x: x + 0.5 * jax.random.normal(jax.random.key(1), x.shape, x.dtype),
        lora.init(host, seed=0))
    got = Sampler(trainer.deployer, model, max_new_tokens=N_NEW, prompt_len=WIDTH,
                  do_sample=False, eos_token_id=(), pad_token_id=PAD, lora=lora).sample(
        PROMPTS, adapters, 1, frozen_params=trainer.params)
    assert got == direct(model, lora.merge(host, adapters), PROMPTS, eos_token_id=()).tolist()
    assert got != direct(model, host, PROMPTS, eos_token_id=()).tolist()  # the adapters count


def test_mistakes_are_named_with_the_fix(setup):
    model, trainer, host, _ = setup
    sampler = Sampler(trainer.deployer, model, max_new_tokens=2, prompt_len=4)
    with pytest.raises(DataError, match="prompt_len=4"):
        sampler.sample([[1, 2, 3, 4, 5]], host, 1)
    with pytest.raises(ConfigError, match="lora"):
        sampler.sample(PROMPTS, host, 1, frozen_params=host)
    with pytest.raises(ConfigError, match="frozen_params"):
        Sampler(trainer.deployer, model, max_new_tokens=2, lora=redcoast.LoRA()).sample(
            PROMPTS, host, 1)
    with pytest.raises(ConfigError, match="positive integer"):
        sampler.sample(PROMPTS, host, 1, n=0)
    with pytest.raises(ConfigError, match="rng"):
        Sampler(trainer.deployer, model, max_new_tokens=2, rng=jax.random.key(0))
    with pytest.raises(ConfigError, match="params is a Trainer.*pass trainer.params"):
        sampler.sample(PROMPTS, trainer, 1)
    with pytest.raises(ConfigError, match="per_device_batch_size=0"):
        sampler.sample([[1, 2]], host, 0)
    with pytest.raises(DataError, match="a prompt is str.*encode"):
        sampler.sample(["What is 1 + 1?"], host, 1)
    with pytest.raises(DataError, match="float values"):
        sampler.sample([[1, 2.5]], host, 1)
    with pytest.raises(DataError, match="no tokens"):
        sampler.sample([[]], host, 1)
    # an id past the embeddings (a token added to the tokenizer alone) would generate garbage
    with pytest.raises(DataError, match=r"token id 96, outside the model's vocabulary \(0 to 95"):
        sampler.sample([[1, 96]], host, 1)
    assert sampler.sample([], host, 1) == []


def test_logprobs_are_the_sampling_distributions_on_one_device(setup):
    model, trainer, host, _ = setup
    lora = redcoast.LoRA(rank=2, alpha=4.0)
    adapters = jax.tree_util.tree_map(
        lambda x: x + 0.5 * jax.random.normal(jax.random.key(1), x.shape, x.dtype),
        lora.init(host, seed=0))
    rows = pad_sequences([{"input_ids": p + [7, 8], "loss_mask": [0] * len(p) + [1, 1]}
                          for p in PROMPTS], 12, pad_id=PAD)
    sampler = Sampler(trainer.deployer, model, max_new_tokens=N_NEW, temperature=0.7, lora=lora)
    got = np.stack(sampler.logprobs(rows, adapters, 1, frozen_params=trainer.params))
    ids, targets, segments = (np.stack([r[k] for r in rows])
                              for k in ("input_ids", "targets", "segment_ids"))
    logits = model.apply(lora.merge(host, adapters), ids, segment_ids=segments)
    np.testing.assert_allclose(got, token_logprobs(logits / 0.7, targets), rtol=1e-5, atol=1e-5)


def test_parameters_kept_from_before_an_update_are_named_as_deleted(setup):
    model, trainer, host, _ = setup
    small = redcoast.Trainer(trainer.deployer, collate, model.apply, loss_fn, host, optax.sgd(0.1))
    before = small.params
    small.train([np.arange(12, dtype=np.int32) % 90 + 3 for _ in range(8)], 1)
    sampler = Sampler(trainer.deployer, model, max_new_tokens=2, prompt_len=WIDTH)
    with pytest.raises(ConfigError, match="deleted.*read trainer.params"):
        sampler.sample(PROMPTS, before, 1)
    assert len(sampler.sample(PROMPTS, small.params, 1)) == 3  # read afresh: the update's
