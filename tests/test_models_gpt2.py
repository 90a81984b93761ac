"""GPT-2 against PyTorch transformers: logits on a left-padded batch, cached decoding against the
full forward pass, folders written both ways, and heads split over two model shards."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import redcoast
from redcoast.models import from_pretrained, gpt2
from redcoast.models.base import Model

torch = pytest.importorskip("torch", reason="test-only reference: pip install torch==2.13.0 transformers")
transformers = pytest.importorskip("transformers", reason="test-only reference: pip install transformers")

from hf_reference import check_round_trip  # noqa: E402

VOCAB = 96
GPT2 = gpt2.GPT2LMHeadModel


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)  # initializer_range 0.2: logits of a few units, so 1e-4 discriminates
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=4, bos_token_id=0, eos_token_id=0,
                                     initializer_range=0.2)
    ref = transformers.GPT2LMHeadModel(config).eval()
    folder = str(tmp_path_factory.mktemp("gpt2"))
    ref.save_pretrained(folder)
    return ref, folder


def _left_padded(seed=0, t=9):
    rs = np.random.RandomState(seed)
    ids = rs.randint(1, VOCAB, (3, t)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0
    ids[mask == 0] = 0
    return ids, mask


def _reference_logits(ref, ids, mask):
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)  # GPT-2 positions under left padding
    with torch.no_grad():
        out = ref(input_ids=torch.tensor(ids, dtype=torch.long),
                  attention_mask=torch.tensor(mask, dtype=torch.long),
                  position_ids=torch.tensor(positions, dtype=torch.long))
    return out.logits.numpy()


def test_logits_match_transformers_on_a_left_padded_batch(tiny):
    ref, folder = tiny
    ids, mask = _left_padded()
    model, params = from_pretrained(folder)
    got = np.asarray(jax.jit(model.apply)(params, ids, mask))
    assert got.dtype == np.float32 and got.shape == (3, 9, VOCAB)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], _reference_logits(ref, ids, mask)[real], atol=1e-4)
    # no mask: every token real, positions 0..T-1
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(jax.jit(model.apply)(params, ids)), want, atol=1e-4)


def test_cached_decoding_equals_the_full_forward_pass(tiny):
    _, folder = tiny
    model, params = from_pretrained(folder)
    ids, mask = _left_padded(1, t=10)
    prompt_len, max_len = 6, 12
    full = np.asarray(jax.jit(model.apply)(params, ids, mask))

    slot_mask = np.zeros((3, max_len), np.int32)
    slot_mask[:, :10] = mask  # the slots this test will fill (prompt, then one token per step)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    step = jax.jit(lambda p, x, pos, c, i: model.apply(p, x, slot_mask, pos, c, i))
    cache = model.init_cache(3, max_len)
    logits, cache = step(params, ids[:, :prompt_len], positions[:, :prompt_len], cache,
                         jnp.int32(0))
    got = [np.asarray(logits)]
    for t in range(prompt_len, 10):
        logits, cache = step(params, ids[:, t:t + 1], positions[:, t:t + 1], cache, jnp.int32(t))
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    assert jax.tree_util.tree_leaves(cache)[0].shape == (3, max_len, 4, 8)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], full[real], atol=1e-5)


def test_round_trip_through_transformers_is_exact(tiny, tmp_path):
    ref, folder = tiny
    model, params = from_pretrained(folder)
    check_round_trip(ref, model, params, transformers.GPT2LMHeadModel, tmp_path)


def test_sharded_loading_splits_heads_and_gives_the_same_logits(tiny):
    _, folder = tiny
    model, params = from_pretrained(folder)
    deployer = redcoast.Deployer(n_model_shards=2, verbose=False)
    plan = deployer.get_sharding_plan(model.abstract_params(), traced_fn=model.apply,
                                      example_args=gpt2.example_inputs(model.config, GPT2))
    attn = plan.param_specs["h"]["0"]["attn"]
    assert attn["c_attn"]["kernel"] == P(None, None, "mp")  # by heads, across Q, K and V alike
    assert attn["c_proj"]["kernel"] == P("mp")

    sharded_model, sharded = from_pretrained(folder, deployer)
    kernel = sharded["h"]["0"]["attn"]["c_attn"]["kernel"]
    assert kernel.addressable_shards[0].data.shape == (32, 3, 16)
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(params["h"]["0"]["attn"]["c_attn"]["kernel"]))
    ids, mask = _left_padded(2)
    want = np.asarray(jax.jit(model.apply)(params, ids, mask))
    got = np.asarray(jax.jit(sharded_model.apply)(sharded, ids, mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-5)


def test_remat_gives_the_same_gradients(tiny):
    _, folder = tiny
    model, params = from_pretrained(folder)
    remat = Model(GPT2, dataclasses.replace(model.config, remat=True))
    ids, mask = _left_padded(3)
    loss = lambda m: lambda p: m.apply(p, ids, mask).mean()  # noqa: E731
    g1, g2 = jax.jit(jax.grad(loss(model)))(params), jax.jit(jax.grad(loss(remat)))(params)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g1, g2)


def test_greedy_generation_equals_transformers(tiny):
    from redcoast.models import generate

    ref, folder = tiny
    ids, mask = _left_padded(seed=3)
    model, params = from_pretrained(folder)
    got = np.asarray(generate(model, params, ids, mask, max_new_tokens=8, eos_token_id=0,
                              pad_token_id=0))
    with torch.no_grad():
        want = ref.generate(input_ids=torch.tensor(ids, dtype=torch.long),
                            attention_mask=torch.tensor(mask, dtype=torch.long), do_sample=False,
                            max_new_tokens=8, eos_token_id=0, pad_token_id=0).numpy()[:, ids.shape[1]:]
    assert want.shape[1] > 0
    np.testing.assert_array_equal(got[:, :want.shape[1]], want)
    assert (got[:, want.shape[1]:] == 0).all()  # transformers stops once every row ended
