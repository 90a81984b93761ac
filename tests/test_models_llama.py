"""The Llama family (Llama 2/3, Mistral, Qwen2) against PyTorch transformers: logits, cached
decoding, sharded loading and Hugging Face folders written both ways."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import redcoast
from redcoast.errors import ConfigError
from redcoast.models import from_pretrained, hf, llama, save_pretrained
from redcoast.models.pretrained import from_reader

torch = pytest.importorskip("torch", reason="test-only reference: pip install torch==2.13.0 transformers")
transformers = pytest.importorskip("transformers")

from hf_reference import bytes_read_per_device, counting_reads  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_tied": ("LlamaConfig", "LlamaForCausalLM",
                    {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    "llama_bias_linear_rope": ("LlamaConfig", "LlamaForCausalLM", {
        "attention_bias": True, "mlp_bias": True,
        "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}),
    "dynamic_rope": ("LlamaConfig", "LlamaForCausalLM", {  # grows past 6 positions
        "max_position_embeddings": 6,
        "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}),
    "yarn_rope": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                            "original_max_position_embeddings": 16}}),
    # Qwen2: q/k/v biases; the second layer uses a sliding window (max_window_layers=1)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
}
SEQ = 10


def _write_reference(folder, variant, seed=0):
    """A random PyTorch model of ``variant`` saved to ``folder`` (weights scaled up so that the
    logits are of order one and a 1e-4 comparison means something)."""
    config_name, model_name, extra = VARIANTS[variant]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**TINY, **extra})
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    return model


def _torch_logits(model, ids, mask=None):
    kwargs = {}
    if mask is not None:  # the positions redcoast uses by default for left padding
        kwargs = dict(attention_mask=torch.tensor(mask),
                      position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0)))
    with torch.no_grad():
        return model(torch.tensor(ids), **kwargs).logits.float().numpy()


def _batch(seed=0):
    rs = np.random.RandomState(seed)
    ids = rs.randint(0, TINY["vocab_size"], (3, SEQ))
    mask = np.ones((3, SEQ), np.int64)
    mask[1, :3] = 0  # left padding
    mask[2, :6] = 0
    return ids, mask


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """variant -> (folder, torch model), written once per module."""
    cache = {}

    def get(variant):
        if variant not in cache:
            folder = tmp_path_factory.mktemp(variant)
            cache[variant] = (str(folder), _write_reference(folder, variant))
        return cache[variant]
    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_pytorch(folders, variant):
    folder, ref = folders(variant)
    model, params = from_pretrained(folder)
    ids, mask = _batch()  # row 0 unpadded, rows 1 and 2 left-padded
    logits = np.asarray(jax.jit(model.apply)(params, jnp.asarray(ids), jnp.asarray(mask)))
    expected = _torch_logits(ref, ids, mask)
    assert np.abs(expected).max() > 0.5  # the comparison is not between near-zero numbers
    real = mask.astype(bool)  # padding positions are not compared
    np.testing.assert_allclose(logits[real], expected[real], atol=1e-4, rtol=0)


def test_cached_decoding_matches_full_forward(folders):
    """Prefill 5 tokens, then decode one at a time, on Mistral (its sliding window of 4 slots
    takes effect in the cache): the logits of PyTorch's full forward pass."""
    folder, ref = folders("mistral")
    model, params = from_pretrained(folder)
    ids, mask = _batch(seed=1)
    full = _torch_logits(ref, ids, mask)
    max_len, prompt = SEQ + 2, 5
    slot_mask = jnp.asarray(np.pad(mask, ((0, 0), (0, max_len - SEQ))))
    positions = jnp.asarray(np.maximum(np.cumsum(mask, -1) - 1, 0))

    @jax.jit
    def step(params, cache, tokens, pos, index):
        return model.apply(params, tokens, slot_mask, pos, cache, index)

    cache = model.init_cache(3, max_len)
    logits, cache = step(params, cache, jnp.asarray(ids[:, :prompt]), positions[:, :prompt],
                         jnp.int32(0))
    outs = [np.asarray(logits)]
    for t in range(prompt, SEQ):
        logits, cache = step(params, cache, jnp.asarray(ids[:, t:t + 1]), positions[:, t:t + 1],
                             jnp.int32(t))
        outs.append(np.asarray(logits))
    cached = np.concatenate(outs, axis=1)
    real = mask.astype(bool)
    np.testing.assert_allclose(cached[real], full[real], atol=1e-4, rtol=0)
    assert jax.tree_util.tree_leaves(cache)[0].shape == (3, max_len, 2, 16)


def test_sharded_loading(tmp_path, monkeypatch):
    """n_model_shards 1, 2, 4: the same logits, parameters split, each device reads its share."""
    folder = tmp_path / "m"
    # 4 key/value heads so that attention also splits four ways
    _write_reference_with(folder, num_attention_heads=8, num_key_value_heads=4)
    ids, mask = _batch()
    results = {}
    reads = counting_reads(monkeypatch)
    for n in (1, 2, 4):
        reads.clear()
        deployer = redcoast.Deployer(n_model_shards=n, verbose=False)
        model, params = from_pretrained(str(folder), deployer)
        per_device = bytes_read_per_device(model, params, reads)
        total = sum(a.nbytes for a in jax.tree_util.tree_leaves(params))
        for device, nbytes in per_device.items():
            share = sum(s.data.nbytes for a in jax.tree_util.tree_leaves(params)
                        for s in a.addressable_shards if s.device == device)
            assert nbytes <= 1.5 * share, (n, device, nbytes, share)
            assert share <= 1.1 * total / n, (n, share, total)  # the split is real
        attn = params["layers"]["0"]["self_attn"]
        if n > 1:
            assert "mp" in attn["q_proj"]["kernel"].sharding.spec
            assert "mp" in attn["k_proj"]["kernel"].sharding.spec
            assert "mp" in params["embed_tokens"]["embedding"].sharding.spec
            shard = attn["q_proj"]["kernel"].addressable_shards[0].data
            assert shard.shape == (64, 64 // n)
        results[n] = np.asarray(jax.jit(model.apply)(params, jnp.asarray(ids), jnp.asarray(mask)))
    real = mask.astype(bool)
    for n in (2, 4):
        np.testing.assert_allclose(results[n][real], results[1][real], atol=1e-5, rtol=0)


def _write_reference_with(folder, **overrides):
    torch.manual_seed(3)
    config = transformers.LlamaConfig(**{**TINY, **overrides})
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("variant", ["llama3_tied", "qwen2"])
def test_round_trip_through_transformers(folders, tmp_path, variant):
    source, _ = folders(variant)
    model, params = from_pretrained(source)
    ours = tmp_path / "redcoast"
    save_pretrained(model, params, str(ours))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(ours)).eval()
    assert type(reloaded).__name__ == VARIANTS[variant][1]
    ids, _ = _batch(seed=2)
    np.testing.assert_allclose(_torch_logits(reloaded, ids),
                               np.asarray(jax.jit(model.apply)(params, jnp.asarray(ids))),
                               atol=1e-4, rtol=0)
    theirs = tmp_path / "transformers"
    reloaded.save_pretrained(str(theirs))
    model2, params2 = from_pretrained(str(theirs))
    assert model2.config == model.config
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


def test_config_round_trip():
    for variant, (config_name, _, extra) in VARIANTS.items():
        config_dict = getattr(transformers, config_name)(**{**TINY, **extra}).to_dict()
        config = llama.LlamaConfig.from_hf(config_dict)
        assert llama.LlamaConfig.from_hf(config.to_hf()) == config, variant
        assert config.to_hf()["model_type"] == config_dict["model_type"]
    qwen = llama.LlamaConfig.from_hf(transformers.Qwen2Config(**TINY).to_dict())
    assert qwen.attention_bias and not qwen.attention_out_bias and qwen.layer_window(1) is None
    # transformers v4 wrote rope_theta and rope_scaling ("type") at the top level
    v4 = {"model_type": "llama", **TINY, "rope_theta": 5e5,
          "rope_scaling": {"type": "linear", "factor": 2.0}}
    config = llama.LlamaConfig.from_hf(v4)
    assert config.rope_theta == 5e5 and dict(config.rope_scaling) == {"rope_type": "linear",
                                                                       "factor": 2.0}
    with pytest.raises(ConfigError, match="longrope"):
        llama.LlamaConfig.from_hf({**v4, "rope_scaling": {"rope_type": "longrope"}})


def test_compute_dtype_and_remat(folders):
    folder, ref = folders("llama")
    ids, mask = _batch()
    args = (jnp.asarray(ids), jnp.asarray(mask))
    real = mask.astype(bool)
    expected = _torch_logits(ref, ids, mask)

    bf16, params = from_pretrained(folder, config_overrides={"dtype": jnp.bfloat16})
    low = jax.jit(bf16.apply)(params, *args)
    assert low.dtype == jnp.float32 and params["norm"]["scale"].dtype == jnp.float32
    assert np.abs(np.asarray(low)[real] - expected[real]).max() < 0.1

    # remat: the gradients of PyTorch's autograd
    remat, params = from_pretrained(folder, config_overrides={"remat": True})
    weights = jnp.asarray(real, jnp.float32)[..., None]
    grads = jax.jit(jax.grad(lambda p: jnp.sum((remat.apply(p, *args) * weights) ** 2)))(params)
    ref.zero_grad()
    kwargs = dict(attention_mask=torch.tensor(mask),
                  position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0)))
    out = ref(torch.tensor(ids), **kwargs).logits
    (out * torch.tensor(np.asarray(weights))).pow(2).sum().backward()
    layer = ref.model.layers[1]
    pairs = [(grads["layers"]["1"]["self_attn"]["q_proj"]["kernel"], layer.self_attn.q_proj.weight.grad.T),
             (grads["layers"]["1"]["mlp"]["down_proj"]["kernel"], layer.mlp.down_proj.weight.grad.T),
             (grads["embed_tokens"]["embedding"], ref.model.embed_tokens.weight.grad)]
    for ours, theirs in pairs:
        theirs = theirs.numpy()
        np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4 * np.abs(theirs).max(), rtol=0)


def test_in_memory_tensors_load_like_the_folder(folders):
    folder, _ = folders("qwen2")
    model, params = from_pretrained(folder)
    reader = hf.SafetensorsFolder(folder)
    tensors = {name: reader.read(name) for name in reader.names()}
    _, again = from_reader(hf.read_config(folder), hf.TensorDict(tensors))
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, again)


def test_hub_name_is_a_clear_error():
    with pytest.raises(ConfigError, match="hub name"):
        from_pretrained("meta-llama/Llama-3.2-1B")
