"""Checks shared by the tests of the Hugging Face families (GPT-J, OPT, BART, ViT): random tiny
PyTorch references, left-padded batches, generation compared token by token, and loading on
several model shards with each device reading only its slice."""

import jax
import numpy as np
import pytest

import redcoast
from redcoast.models import from_pretrained, hf
from redcoast.models.pretrained import family_of

torch = pytest.importorskip("torch", reason="test-only reference: pip install torch==2.13.0 transformers")
transformers = pytest.importorskip("transformers", reason="test-only reference: pip install transformers")


def randomize(model, seed=0, std=0.15):
    """Weights of order 0.1 and norm scales near 1, so logits are of order one and a 1e-4
    comparison discriminates (the default initialisations give near-zero logits)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    return model.eval()


def left_padded(vocab, rows=3, t=9, seed=0, low=3):
    """``(ids, mask)`` int64 [rows, t]: row 0 full, the others padded on the left."""
    rs = np.random.RandomState(seed)
    ids = rs.randint(low, vocab, (rows, t))
    mask = np.ones_like(ids)
    for r in range(1, rows):
        mask[r, :min(t - 1, 3 * r)] = 0
    ids[mask == 0] = 1
    return ids, mask


def torch_logits(ref, ids, mask, **kwargs):
    """The reference's logits with the positions redcoast uses under left padding."""
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        return ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                   position_ids=torch.tensor(positions), **kwargs).logits.float().numpy()


def same_tokens(ours, theirs, eos, pad):
    """Equal up to each row's first EOS and ``pad`` after it (transformers stops once every row
    ended, so its output may be shorter; its beam search pads with EOS when pad is 0)."""
    ours = np.asarray(ours)
    after_eos = np.cumsum(np.cumsum(theirs == eos, axis=1), axis=1) > 1
    np.testing.assert_array_equal(ours[:, :theirs.shape[1]], np.where(after_eos, pad, theirs))
    assert (ours[:, theirs.shape[1]:] == pad).all()


def counting_reads(monkeypatch):
    """Record ``(tensor name, bytes)`` of every slice read from a safetensors folder."""
    reads = []
    original = hf.SafetensorsFolder.read

    def read(self, name, index=None):
        out = original(self, name, index)
        reads.append((name, out.nbytes))
        return out
    monkeypatch.setattr(hf.SafetensorsFolder, "read", read)
    return reads


def bytes_read_per_device(model, params, reads):
    """Bytes read on behalf of each device (``make_array_from_callback`` reads once per
    addressable device, in the order of ``addressable_devices_indices_map``; once in all for a
    replicated parameter)."""
    family = family_of(model.config.to_hf()["model_type"])
    sources = jax.tree_util.tree_leaves(family.hf_sources(model.config, model.module_cls),
                                        is_leaf=lambda x: isinstance(x, hf.Source))
    by_name = {}
    for name, nbytes in reads:
        by_name.setdefault(name, []).append(nbytes)
    per_device = {}
    for src, array in zip(sources, jax.tree_util.tree_leaves(params)):
        devices = list(array.sharding.addressable_devices_indices_map(array.shape))
        counts = by_name[src.name]
        if array.sharding.is_fully_replicated:
            assert counts == [array.nbytes]
            counts = counts * len(devices)
        assert len(counts) == len(devices)
        for device, nbytes in zip(devices, counts):
            per_device[device] = per_device.get(device, 0) + nbytes
    return per_device


def check_sharded_loading(folder, monkeypatch, forward, split_path, shards=(1, 2, 4), atol=1e-5):
    """Loaded on each of ``shards`` model shards: ``forward(model, params)`` gives the same
    numbers, the weight at ``split_path`` is split over 'mp', and each device reads no more
    than (about) the slices it holds."""
    reads = counting_reads(monkeypatch)
    results = {}
    for n in shards:
        reads.clear()
        model, params = from_pretrained(folder, redcoast.Deployer(n_model_shards=n, verbose=False))
        leaves = jax.tree_util.tree_leaves(params)
        replicated = sum(a.nbytes for a in leaves if a.sharding.is_fully_replicated)
        split = sum(a.nbytes for a in leaves) - replicated
        assert n == 1 or split > replicated, (n, split, replicated)  # mostly split
        for device, nbytes in bytes_read_per_device(model, params, reads).items():
            held = sum(s.data.nbytes for a in leaves for s in a.addressable_shards
                       if s.device == device)
            assert nbytes <= 1.5 * held, (n, device, nbytes, held)
            assert held <= split / n + replicated, (n, held, split, replicated)  # n ways
        weight = params
        for key in split_path:
            weight = weight[key]
        if n > 1:
            assert "mp" in weight.sharding.spec, (n, weight.sharding.spec)
        results[n] = forward(model, params)
    for n in shards[1:]:
        jax.tree_util.tree_map(
            lambda a, b: np.testing.assert_allclose(a, b, atol=atol, rtol=0), results[n],
            results[shards[0]])


def check_round_trip(ref, model, params, hf_class, folder):
    """Saved by redcoast, ``hf_class`` (transformers) loads ``ref``'s exact tensors; a fresh
    redcoast model saved, loaded and re-saved by transformers reads back to the same config and
    arrays. Returns the transformers model loaded from redcoast's folder."""
    from redcoast.models import Model, from_pretrained, save_pretrained

    save_pretrained(model, params, str(folder / "ours"))
    back = hf_class.from_pretrained(str(folder / "ours"))
    got = back.state_dict()
    for name, value in ref.state_dict().items():
        assert torch.equal(got[name], value), name

    fresh = Model(model.module_cls, model.config)
    new = fresh.init(seed=1)
    save_pretrained(fresh, new, str(folder / "fresh"))
    hf_class.from_pretrained(str(folder / "fresh")).save_pretrained(str(folder / "again"))
    again_model, again = from_pretrained(str(folder / "again"))
    assert again_model.config == model.config
    jax.tree_util.tree_map(np.testing.assert_array_equal, new, again)
    return back


def check_greedy_generation(ref, model, params, vocab, pad=1, max_new_tokens=8):
    """Greedy tokens on a left-padded batch equal transformers' ``generate``, with an EOS the
    model does produce, so rows end at different steps."""
    from redcoast.models import generate

    ids, mask = left_padded(vocab, seed=3)
    kw = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
              max_new_tokens=max_new_tokens, pad_token_id=pad)
    with torch.no_grad():
        free = ref.generate(**kw, eos_token_id=None).numpy()[:, ids.shape[1]:]
        eos = int(free[1, 2])
        want = ref.generate(**kw, eos_token_id=eos).numpy()[:, ids.shape[1]:]
    got = generate(model, params, ids, mask, max_new_tokens=max_new_tokens, eos_token_id=eos,
                   pad_token_id=pad)
    assert (want == eos).any()
    same_tokens(got, want, eos, pad=pad)
