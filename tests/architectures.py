"""Small models in many styles, each with a loss and a batch, for the data-flow sharding tests.

Every builder ``make(n_layers)`` returns an :class:`Arch`. Widths are chosen so that every
dimension differs (hidden 32, 8 heads of 4, ffn 64, vocab 40, sequence 8): a placement that is
right here is right for a reason, not by a coincidence of shapes. ``expected[n]`` holds the specs
of the key weights on ``n`` model shards, keyed by '/'-joined paths.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

B, T, H, NH, HD, F, V = 8, 8, 32, 8, 4, 64, 40
COL, ROW, REP = P(None, "mp"), P("mp"), P()


@dataclasses.dataclass
class Arch:
    name: str
    params: object
    loss: object          # loss(params, batch) -> scalar
    batch: dict
    expected: dict        # {n_model_shards: {path: PartitionSpec}}
    hidden: int = H
    seq: int = T
    cross_attention: bool = False
    recompute: bool = False  # layers under jax.checkpoint: their forward runs again in the backward


class _Init:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def __call__(self, *shape, scale=0.2):
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    def ones(self, *shape):
        return np.ones(shape, np.float32)

    def zeros(self, *shape):
        return np.zeros(shape, np.float32)


def _tokens(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (B, T + 1)).astype(np.int32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


# XLA's cheapest CPU compile: an init runs once (a U-Net's: 3 s, not 12 s eager or jitted)
_QUICK = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def quick_init(model, seed, *args, **kwargs):
    """A Flax linen model's variables: ``model.init``, compiled quickly."""
    key = jax.random.key(seed)
    init = jax.jit(lambda key, *a: model.init(key, *a, **kwargs))
    return init.lower(key, *args).compile(compiler_options=_QUICK)(key, *args)


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def layer_norm(x, scale, bias):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def attend(q, k, v, causal=True):
    """q, k, v: (batch, seq, heads, head_dim) -> (batch, seq, heads, head_dim)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
        s = jnp.where(mask, s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def heads(x):
    return x.reshape(x.shape[:-1] + (NH, x.shape[-1] // NH))


def merge(x):
    return x.reshape(x.shape[:-2] + (-1,))


def cross_entropy(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def rope(x):
    """Rotary embedding on (b, t, heads, head_dim) from constant tables."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (np.arange(half) / half))
    ang = np.arange(x.shape[1])[:, None] * freq[None]
    cos, sin = jnp.asarray(np.cos(ang), x.dtype)[None, :, None], jnp.asarray(np.sin(ang), x.dtype)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


# ---- 1. plain JAX, meaningless names, dict order unrelated to the forward pass -------------
def plain_jax(n_layers=2, seed=0):
    w = _Init(seed)
    blocks = [{"m3": w(F, H), "m1b": w.zeros(F), "a0": w(H, H), "n2": w.ones(H), "a7": w(H, H),
               "m1": w(H, F), "a2": w(H, H), "m3b": w.zeros(H), "n1": w.ones(H), "a5": w(H, H)}
              for _ in range(n_layers)]
    params = {"q9": w.ones(H), "blocks": blocks, "e": w(V, H)}

    def loss(p, batch):
        h = p["e"][batch["inputs"]]
        for blk in p["blocks"]:
            x = rms_norm(h, blk["n1"])
            o = attend(heads(x @ blk["a7"]), heads(x @ blk["a2"]), heads(x @ blk["a5"]))
            h = h + merge(o) @ blk["a0"]
            x = rms_norm(h, blk["n2"])
            h = h + jax.nn.gelu(x @ blk["m1"] + blk["m1b"]) @ blk["m3"] + blk["m3b"]
        return cross_entropy(rms_norm(h, p["q9"]) @ p["e"].T, batch["targets"])

    exp = {f"blocks/0/{k}": COL for k in ("a7", "a2", "a5", "m1")}
    exp.update({"blocks/0/a0": ROW, "blocks/0/m3": ROW, "blocks/0/m1b": ROW, "blocks/0/m3b": REP,
                "blocks/0/n1": REP, "e": ROW, "q9": REP})
    return Arch("plain_jax", params, loss, _tokens(), {4: exp, 2: exp})


# ---- 2. Flax Linen: Embed, MultiHeadDotProductAttention (3-D kernels), Dense ----------------
def flax_linen(n_layers=2, seed=0):
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.LayerNorm()(x)
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + nn.MultiHeadDotProductAttention(num_heads=NH, qkv_features=H)(y, y, mask=mask)
            y = nn.LayerNorm()(x)
            return x + nn.Dense(H)(nn.gelu(nn.Dense(F)(y)))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(V, H)(ids)
            for _ in range(n_layers):
                x = Block()(x)
            return nn.Dense(V, use_bias=False)(nn.LayerNorm()(x))

    model = LM()
    batch = _tokens()
    params = jax.tree_util.tree_map(np.asarray, model.init(jax.random.key(seed), batch["inputs"])["params"])

    def loss(p, batch):
        return cross_entropy(model.apply({"params": p}, batch["inputs"]), batch["targets"])

    a = "Block_0/MultiHeadDotProductAttention_0/"
    exp = {a + "query/kernel": COL, a + "key/kernel": COL, a + "value/kernel": COL,
           a + "query/bias": ROW, a + "out/kernel": ROW, a + "out/bias": REP,
           # Flax names Dense(H) first: it is built before the Dense(F) nested in its call
           "Block_0/Dense_1/kernel": COL, "Block_0/Dense_1/bias": ROW, "Block_0/Dense_0/kernel": ROW,
           "Block_0/Dense_0/bias": REP, "Block_0/LayerNorm_0/scale": REP,
           "Embed_0/embedding": ROW, "Dense_0/kernel": COL}
    return Arch("flax_linen", params, loss, batch, {4: exp, 2: exp})


def nnx_lm(block, n_layers, seed):
    """``(params, forward(params, ids))``: a Flax NNX LM (embedding, ``n_layers`` of
    ``block(rngs)``, RMSNorm, head) split into a params pytree and a pure apply, as NNX users
    hand one to a JAX trainer."""
    from flax import nnx

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(V, H, rngs=rngs)
            self.blocks = nnx.List([block(rngs) for _ in range(n_layers)])
            self.norm = nnx.RMSNorm(H, rngs=rngs)
            self.head = nnx.Linear(H, V, use_bias=False, rngs=rngs)

        def __call__(self, ids):
            x = self.embed(ids)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x))

    graphdef, state = nnx.split(LM(nnx.Rngs(seed)))
    params = jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(state))

    def forward(p, ids):
        st = jax.tree_util.tree_map(lambda x: x, state)
        nnx.replace_by_pure_dict(st, p)
        return nnx.merge(graphdef, st)(ids)
    return params, forward


# ---- 3. Flax NNX, split into a params pytree and a pure apply; SwiGLU MLP --------------------
def flax_nnx(n_layers=2, seed=0):
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm1, self.norm2 = nnx.RMSNorm(H, rngs=rngs), nnx.RMSNorm(H, rngs=rngs)
            self.wq, self.wk, self.wv, self.wo = (nnx.Linear(H, H, use_bias=False, rngs=rngs) for _ in range(4))
            self.gate, self.up = nnx.Linear(H, F, use_bias=False, rngs=rngs), nnx.Linear(H, F, use_bias=False, rngs=rngs)
            self.down = nnx.Linear(F, H, use_bias=False, rngs=rngs)

        def __call__(self, x):
            y = self.norm1(x)
            x = x + self.wo(merge(attend(heads(self.wq(y)), heads(self.wk(y)), heads(self.wv(y)))))
            y = self.norm2(x)
            return x + self.down(nnx.silu(self.gate(y)) * self.up(y))

    params, forward = nnx_lm(Block, n_layers, seed)

    def loss(p, batch):
        return cross_entropy(forward(p, batch["inputs"]), batch["targets"])

    b = "blocks/0/"
    exp = {b + "wq/kernel": COL, b + "wk/kernel": COL, b + "wv/kernel": COL, b + "wo/kernel": ROW,
           b + "gate/kernel": COL, b + "up/kernel": COL, b + "down/kernel": ROW,
           b + "norm1/scale": REP, "embed/embedding": ROW, "head/kernel": COL}
    return Arch("flax_nnx", params, loss, _tokens(), {4: exp, 2: exp})


# ---- 4. PyTorch layout: (out, in) weights used as x @ W.T, a flat state dict, RoPE, SwiGLU -----
def transposed(n_layers=2, seed=0):
    w = _Init(seed)
    params = {"embed_tokens.weight": w(V, H)}
    for i in range(n_layers):
        pre = f"layers.{i}."
        params.update({pre + "input_layernorm.weight": w.ones(H),
                       pre + "self_attn.q_proj.weight": w(H, H), pre + "self_attn.k_proj.weight": w(H, H),
                       pre + "self_attn.v_proj.weight": w(H, H), pre + "self_attn.o_proj.weight": w(H, H),
                       pre + "post_attention_layernorm.weight": w.ones(H),
                       pre + "mlp.gate_proj.weight": w(F, H), pre + "mlp.up_proj.weight": w(F, H),
                       pre + "mlp.down_proj.weight": w(H, F)})
    params.update({"norm.weight": w.ones(H), "lm_head.weight": w(V, H)})

    def loss(p, batch):
        h = p["embed_tokens.weight"][batch["inputs"]]
        for i in range(n_layers):
            g = lambda name: p[f"layers.{i}.{name}.weight"]
            x = rms_norm(h, g("input_layernorm"))
            q, k = rope(heads(x @ g("self_attn.q_proj").T)), rope(heads(x @ g("self_attn.k_proj").T))
            h = h + merge(attend(q, k, heads(x @ g("self_attn.v_proj").T))) @ g("self_attn.o_proj").T
            x = rms_norm(h, g("post_attention_layernorm"))
            h = h + (jax.nn.silu(x @ g("mlp.gate_proj").T) * (x @ g("mlp.up_proj").T)) @ g("mlp.down_proj").T
        return cross_entropy(rms_norm(h, p["norm.weight"]) @ p["lm_head.weight"].T, batch["targets"])

    pre = "layers.0."
    exp = {pre + "self_attn.q_proj.weight": ROW, pre + "self_attn.k_proj.weight": ROW,
           pre + "self_attn.o_proj.weight": COL, pre + "mlp.gate_proj.weight": ROW,
           pre + "mlp.up_proj.weight": ROW, pre + "mlp.down_proj.weight": COL,
           "embed_tokens.weight": ROW, "lm_head.weight": ROW, "norm.weight": REP}
    return Arch("transposed", params, loss, _tokens(), {4: exp, 2: exp})


# ---- 5. fused projections: Q/K/V in one (hidden, 3, heads, head_dim) kernel, gate/up in one ----
def fused_qkv(n_layers=2, seed=0):
    w = _Init(seed)
    params = {"layers": [{"ln1": w.ones(H), "wqkv": w(H, 3, NH, HD), "wo": w(NH, HD, H),
                          "ln2": w.ones(H), "w13": w(H, 2, F), "w2": w(F, H)} for _ in range(n_layers)],
              "tok": w(V, H), "ln_f": w.ones(H), "out": w(H, V)}

    def loss(p, batch):
        h = p["tok"][batch["inputs"]]
        for lyr in p["layers"]:
            qkv = jnp.einsum("btd,dchk->btchk", rms_norm(h, lyr["ln1"]), lyr["wqkv"])
            o = attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
            h = h + jnp.einsum("bthk,hkd->btd", o, lyr["wo"])
            gu = jnp.einsum("btd,dcf->btcf", rms_norm(h, lyr["ln2"]), lyr["w13"])
            h = h + (jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1]) @ lyr["w2"]
        return cross_entropy(rms_norm(h, p["ln_f"]) @ p["out"], batch["targets"])

    exp = {"layers/0/wqkv": P(None, None, "mp"), "layers/0/wo": ROW, "layers/0/w13": P(None, None, "mp"),
           "layers/0/w2": ROW, "tok": ROW, "out": COL}
    return Arch("fused_qkv", params, loss, _tokens(), {4: exp, 2: exp})


# ---- 6. grouped-query attention: 2 KV heads (fewer than 4 shards), repeated to 8 -----------------
def gqa(n_layers=2, seed=0, kv_heads=2):
    w = _Init(seed)
    g = NH // kv_heads
    params = {"emb": w(V, H), "layers": [
        {"norm": w.ones(H), "q": w(H, NH, HD), "k": w(H, kv_heads, HD), "v": w(H, kv_heads, HD),
         "o": w(NH, HD, H), "norm2": w.ones(H), "up": w(H, F), "down": w(F, H)} for _ in range(n_layers)],
        "final": w.ones(H)}

    def repeat_kv(x):  # (b, t, kv, hd) -> (b, t, kv * g, hd), as Llama's repeat_kv
        b, t = x.shape[:2]
        return jnp.broadcast_to(x[:, :, :, None], (b, t, kv_heads, g, HD)).reshape(b, t, NH, HD)

    def loss(p, batch):
        h = p["emb"][batch["inputs"]]
        for lyr in p["layers"]:
            x = rms_norm(h, lyr["norm"])
            q = rope(jnp.einsum("btd,dhk->bthk", x, lyr["q"]))
            k = rope(jnp.einsum("btd,dhk->bthk", x, lyr["k"]))
            v = jnp.einsum("btd,dhk->bthk", x, lyr["v"])
            h = h + jnp.einsum("bthk,hkd->btd", attend(q, repeat_kv(k), repeat_kv(v)), lyr["o"])
            h = h + jax.nn.relu(rms_norm(h, lyr["norm2"]) @ lyr["up"]) @ lyr["down"]
        return cross_entropy(rms_norm(h, p["final"]) @ p["emb"].T, batch["targets"])

    def kv_spec(n):
        # with fewer KV heads than shards, each KV head is kept by the consecutive shards holding
        # its query heads: split over gcd(kv_heads, shards) groups of the 'mp' axis
        groups = math.gcd(kv_heads, n)
        return COL if groups == n else P(None, f"mp:{groups}") if groups > 1 else REP

    kv4, kv2 = kv_spec(4), kv_spec(2)
    base = {"layers/0/q": COL, "layers/0/o": ROW, "layers/0/up": COL, "layers/0/down": ROW, "emb": ROW}
    return Arch("gqa" if kv_heads > 1 else "mqa", params, loss, _tokens(),
                {4: {**base, "layers/0/k": kv4, "layers/0/v": kv4},
                 2: {**base, "layers/0/k": kv2, "layers/0/v": kv2}})


def mqa(n_layers=2, seed=0):
    return gqa(n_layers, seed, kv_heads=1)


# ---- 7. mixture of experts: top-2 router, stacked expert kernels (experts, in, out) -------------
def moe(n_layers=2, seed=0, n_experts=4):
    w = _Init(seed)
    params = {"embed": w(V, H), "layers": [
        {"ln1": w.ones(H), "wq": w(H, H), "wk": w(H, H), "wv": w(H, H), "wo": w(H, H), "ln2": w.ones(H),
         "router": w(H, n_experts), "w_in": w(n_experts, H, F), "w_out": w(n_experts, F, H)}
        for _ in range(n_layers)], "ln_f": w.ones(H), "unembed": w(H, V)}

    def loss(p, batch):
        h = p["embed"][batch["inputs"]]
        for lyr in p["layers"]:
            x = rms_norm(h, lyr["ln1"])
            h = h + merge(attend(heads(x @ lyr["wq"]), heads(x @ lyr["wk"]), heads(x @ lyr["wv"]))) @ lyr["wo"]
            x = rms_norm(h, lyr["ln2"])
            probs = jax.nn.softmax(x @ lyr["router"], -1)
            top, _ = jax.lax.top_k(probs, 2)
            gates = jnp.where(probs >= top[..., -1:], probs, 0.0)
            hid = jax.nn.gelu(jnp.einsum("btd,edf->btef", x, lyr["w_in"]))
            out = jnp.einsum("btef,efd->bted", hid, lyr["w_out"])
            h = h + jnp.einsum("bted,bte->btd", out, gates)
        return cross_entropy(rms_norm(h, p["ln_f"]) @ p["unembed"], batch["targets"])

    exp = {"layers/0/w_in": ROW, "layers/0/w_out": ROW, "layers/0/router": REP,
           "layers/0/wq": COL, "layers/0/wo": ROW, "embed": ROW, "unembed": COL}
    # 4 experts on 8 shards: each expert is split Megatron-style instead (ffn axis)
    exp8 = {**exp, "layers/0/w_in": P(None, None, "mp"), "layers/0/w_out": P(None, "mp")}
    return Arch("moe", params, loss, _tokens(), {4: exp, 2: exp, 8: exp8})


# ---- 8. encoder-decoder with cross-attention (T5-like, shared embedding) -------------------------
def encoder_decoder(n_layers=2, seed=0):
    """``n_layers`` decoder layers over a one-layer encoder: per-layer traffic is a decoder layer's."""
    w = _Init(seed)

    def attn():
        return {"q": w(H, H), "k": w(H, H), "v": w(H, H), "o": w(H, H)}

    def mlp():
        return {"wi": w(H, F), "wo": w(F, H)}

    params = {"shared": w(V, H),
              "encoder": {"block": [{"ln_a": w.ones(H), "self": attn(), "ln_m": w.ones(H), "mlp": mlp()}],
                          "ln": w.ones(H)},
              "decoder": {"block": [{"ln_a": w.ones(H), "self": attn(), "ln_c": w.ones(H), "cross": attn(),
                                     "ln_m": w.ones(H), "mlp": mlp()} for _ in range(n_layers)],
                          "ln": w.ones(H)}}

    def mha(a, x, kv, causal):
        return merge(attend(heads(x @ a["q"]), heads(kv @ a["k"]), heads(kv @ a["v"]), causal)) @ a["o"]

    def loss(p, batch):
        e = p["shared"][batch["src"]]
        for blk in p["encoder"]["block"]:
            x = rms_norm(e, blk["ln_a"])
            e = e + mha(blk["self"], x, x, False)
            e = e + jax.nn.relu(rms_norm(e, blk["ln_m"]) @ blk["mlp"]["wi"]) @ blk["mlp"]["wo"]
        e = rms_norm(e, p["encoder"]["ln"])
        h = p["shared"][batch["inputs"]]
        for blk in p["decoder"]["block"]:
            x = rms_norm(h, blk["ln_a"])
            h = h + mha(blk["self"], x, x, True)
            h = h + mha(blk["cross"], rms_norm(h, blk["ln_c"]), e, False)
            h = h + jax.nn.relu(rms_norm(h, blk["ln_m"]) @ blk["mlp"]["wi"]) @ blk["mlp"]["wo"]
        return cross_entropy(rms_norm(h, p["decoder"]["ln"]) @ p["shared"].T, batch["targets"])

    batch = _tokens()
    batch["src"] = _tokens(1)["inputs"]
    d = "decoder/block/0/"
    exp = {d + "cross/q": COL, d + "cross/k": COL, d + "cross/v": COL, d + "cross/o": ROW,
           d + "self/q": COL, d + "self/o": ROW, d + "mlp/wi": COL, d + "mlp/wo": ROW,
           "encoder/block/0/self/k": COL, "encoder/block/0/mlp/wo": ROW, "shared": ROW}
    return Arch("encoder_decoder", params, loss, batch, {4: exp, 2: exp}, cross_attention=True)


# ---- 9. layers stacked along a leading axis and run with lax.scan (+ remat) ----------------------
def scan_stacked(n_layers=2, seed=0, remat=True):
    w = _Init(seed)
    L = n_layers
    params = {"embedding": w(V, H), "stack": {
        "norm_a": w.ones(L, H), "wq": w(L, H, NH, HD), "wk": w(L, H, NH, HD), "wv": w(L, H, NH, HD),
        "wo": w(L, NH, HD, H), "norm_m": w.ones(L, H), "w_up": w(L, H, F), "b_up": w.zeros(L, F),
        "w_down": w(L, F, H)}, "norm": w.ones(H), "head": w(H, V)}

    def layer(h, lyr):
        x = rms_norm(h, lyr["norm_a"])
        q, k, v = (jnp.einsum("btd,dhk->bthk", x, lyr[n]) for n in ("wq", "wk", "wv"))
        h = h + jnp.einsum("bthk,hkd->btd", attend(q, k, v), lyr["wo"])
        x = rms_norm(h, lyr["norm_m"])
        return h + jax.nn.gelu(x @ lyr["w_up"] + lyr["b_up"]) @ lyr["w_down"]

    if remat:
        layer = jax.checkpoint(layer)

    def loss(p, batch):
        h = p["embedding"][batch["inputs"]]
        h, _ = jax.lax.scan(lambda c, lyr: (layer(c, lyr), None), h, p["stack"])
        return cross_entropy(rms_norm(h, p["norm"]) @ p["head"], batch["targets"])

    s = "stack/"
    exp = {s + "wq": P(None, None, "mp"), s + "wk": P(None, None, "mp"), s + "wo": P(None, "mp"),
           s + "w_up": P(None, None, "mp"), s + "b_up": P(None, "mp"), s + "w_down": P(None, "mp"),
           s + "norm_a": REP, "embedding": ROW, "head": COL}
    return Arch("scan_stacked", params, loss, _tokens(), {4: exp, 2: exp}, recompute=remat)


# ---- 10. GPT-2: Conv1D (in, out) weights, fused c_attn (hidden, 3*hidden), tied wte, wpe ----------
def gpt2(n_layers=2, seed=0):
    w = _Init(seed)
    ln = lambda: {"weight": w.ones(H), "bias": w.zeros(H)}
    params = {"wte": {"weight": w(V, H)}, "wpe": {"weight": w(T, H)},
              "h": {str(i): {"ln_1": ln(), "attn": {"c_attn": {"weight": w(H, 3 * H), "bias": w.zeros(3 * H)},
                                                    "c_proj": {"weight": w(H, H), "bias": w.zeros(H)}},
                             "ln_2": ln(), "mlp": {"c_fc": {"weight": w(H, F), "bias": w.zeros(F)},
                                                   "c_proj": {"weight": w(F, H), "bias": w.zeros(H)}}}
                    for i in range(n_layers)},
              "ln_f": ln()}

    def conv1d(c, x):
        return x @ c["weight"] + c["bias"]

    def loss(p, batch):
        ids = batch["inputs"]
        h = p["wte"]["weight"][ids] + p["wpe"]["weight"][jnp.arange(ids.shape[1])]
        for i in range(n_layers):
            blk = p["h"][str(i)]
            x = layer_norm(h, blk["ln_1"]["weight"], blk["ln_1"]["bias"])
            q, k, v = jnp.split(conv1d(blk["attn"]["c_attn"], x), 3, axis=-1)
            h = h + conv1d(blk["attn"]["c_proj"], merge(attend(heads(q), heads(k), heads(v))))
            x = layer_norm(h, blk["ln_2"]["weight"], blk["ln_2"]["bias"])
            h = h + conv1d(blk["mlp"]["c_proj"], jax.nn.gelu(conv1d(blk["mlp"]["c_fc"], x)))
        return cross_entropy(layer_norm(h, p["ln_f"]["weight"], p["ln_f"]["bias"]) @ p["wte"]["weight"].T, batch["targets"])

    b = "h/0/"
    exp = {b + "attn/c_attn/weight": REP, b + "attn/c_proj/weight": REP, b + "mlp/c_fc/weight": COL,
           b + "mlp/c_fc/bias": ROW, b + "mlp/c_proj/weight": ROW, b + "mlp/c_proj/bias": REP,
           "wte/weight": ROW, "wpe/weight": REP}
    return Arch("gpt2", params, loss, _tokens(), {4: exp, 2: exp})


# ---- 11. BERT: 3-D DenseGeneral attention kernels, post-LN, token types, tied MLM decoder ----------
def bert(n_layers=2, seed=0):
    w = _Init(seed)
    ln = lambda: {"scale": w.ones(H), "bias": w.zeros(H)}
    dense = lambda *shape: {"kernel": w(*shape), "bias": w.zeros(*shape[-1:])}
    params = {"embeddings": {"word_embeddings": {"embedding": w(V, H)},
                             "position_embeddings": {"embedding": w(T, H)},
                             "token_type_embeddings": {"embedding": w(2, H)}, "LayerNorm": ln()},
              "encoder": {"layer": {str(i): {
                  "attention": {"self": {n: {"kernel": w(H, NH, HD), "bias": w.zeros(NH, HD)}
                                         for n in ("query", "key", "value")},
                                "output": {"dense": {"kernel": w(NH, HD, H), "bias": w.zeros(H)}, "LayerNorm": ln()}},
                  "intermediate": {"dense": dense(H, F)},
                  "output": {"dense": dense(F, H), "LayerNorm": ln()}} for i in range(n_layers)}},
              "cls": {"transform": {"dense": dense(H, H), "LayerNorm": ln()}, "bias": w.zeros(V)}}

    def dg(d, x, spec):
        return jnp.einsum(spec, x, d["kernel"]) + d["bias"]

    def loss(p, batch):
        e = p["embeddings"]
        ids = batch["inputs"]
        h = (e["word_embeddings"]["embedding"][ids] + e["position_embeddings"]["embedding"][jnp.arange(T)]
             + e["token_type_embeddings"]["embedding"][batch["types"]])
        h = layer_norm(h, **e["LayerNorm"])
        for i in range(n_layers):
            lyr = p["encoder"]["layer"][str(i)]
            s = lyr["attention"]["self"]
            q, k, v = (dg(s[n], h, "btd,dhk->bthk") for n in ("query", "key", "value"))
            o = dg(lyr["attention"]["output"]["dense"], attend(q, k, v, causal=False), "bthk,hkd->btd")
            h = layer_norm(h + o, **lyr["attention"]["output"]["LayerNorm"])
            m = jax.nn.gelu(dg(lyr["intermediate"]["dense"], h, "btd,df->btf"))
            h = layer_norm(h + dg(lyr["output"]["dense"], m, "btf,fd->btd"), **lyr["output"]["LayerNorm"])
        t = p["cls"]["transform"]
        x = layer_norm(jax.nn.gelu(dg(t["dense"], h, "btd,de->bte")), **t["LayerNorm"])
        logits = x @ e["word_embeddings"]["embedding"].T + p["cls"]["bias"]
        return cross_entropy(logits, batch["targets"])

    batch = _tokens()
    batch["types"] = (np.arange(T)[None] >= T // 2).repeat(B, 0).astype(np.int32)
    a = "encoder/layer/0/attention/"
    exp = {a + "self/query/kernel": COL, a + "self/query/bias": ROW, a + "self/value/kernel": COL,
           a + "output/dense/kernel": ROW, a + "output/dense/bias": REP,
           "encoder/layer/0/intermediate/dense/kernel": COL, "encoder/layer/0/intermediate/dense/bias": ROW,
           "encoder/layer/0/output/dense/kernel": ROW, "embeddings/word_embeddings/embedding": ROW,
           "embeddings/token_type_embeddings/embedding": REP,  # 2 rows < 4 shards
           "cls/bias": ROW,
           "cls/transform/dense/kernel": REP, "embeddings/LayerNorm/scale": REP}
    return Arch("bert", params, loss, batch,
                {4: exp, 2: {**exp, "embeddings/token_type_embeddings/embedding": ROW}})


# ---- 12. LoRA adapters on a column-parallel and a row-parallel base ----------------------------------
def lora(n_layers=2, seed=0, r=8):
    w = _Init(seed)
    params = {"emb": w(V, H), "layers": [
        {"n1": w.ones(H), "q": {"base": w(H, H), "A": w(H, r), "B": w(r, H)}, "k": w(H, H),
         "v": {"base": w(H, H), "A": w(H, r), "B": w(r, H)}, "o": w(H, H), "n2": w.ones(H),
         "up": {"base": w(H, F), "A": w(H, r), "B": w(r, F)},
         "down": {"base": w(F, H), "A": w(F, r), "B": w(r, H)}} for _ in range(n_layers)],
        "nf": w.ones(H)}

    def lin(a, x):
        return x @ a["base"] + 0.5 * ((x @ a["A"]) @ a["B"])

    def loss(p, batch):
        h = p["emb"][batch["inputs"]]
        for lyr in p["layers"]:
            x = rms_norm(h, lyr["n1"])
            h = h + merge(attend(heads(lin(lyr["q"], x)), heads(x @ lyr["k"]), heads(lin(lyr["v"], x)))) @ lyr["o"]
            x = rms_norm(h, lyr["n2"])
            h = h + lin(lyr["down"], jax.nn.gelu(lin(lyr["up"], x)))
        return cross_entropy(rms_norm(h, p["nf"]) @ p["emb"].T, batch["targets"])

    l0 = "layers/0/"
    exp = {l0 + "q/base": COL, l0 + "q/A": REP, l0 + "q/B": COL, l0 + "v/B": COL, l0 + "o": ROW,
           l0 + "up/base": COL, l0 + "up/A": REP, l0 + "up/B": COL,
           l0 + "down/base": ROW, l0 + "down/A": ROW, l0 + "down/B": REP, "emb": ROW}
    return Arch("lora", params, loss, _tokens(), {4: exp, 2: exp})


# ---- 13. block-sparse attention: per-head key/value blocks gathered by a table (BigBird-like) -----
def block_sparse(n_layers=2, seed=0, block=2, picks=2):
    """Each query block reads ``picks`` key blocks chosen per head: its own and one earlier one.
    K and V blocks are gathered per head and example with ``jnp.take_along_axis``: a gather with
    operand batching dimensions (batch, heads), which must keep the heads split."""
    w = _Init(seed)
    nb = T // block
    rng = np.random.default_rng(seed + 1)
    table = np.array([[[i, rng.integers(0, i + 1)] for i in range(nb)] for _ in range(NH)], np.int32)
    kpos = (table[..., None] * block + np.arange(block)).reshape(NH, nb, picks * block)
    qpos = np.arange(T).reshape(nb, block)
    mask = kpos[:, :, None, :] <= qpos[None, :, :, None]  # (heads, query block, query, key): causal
    params = {"emb": w(V, H), "layers": [
        {"ln1": w.ones(H), "wq": w(H, H), "wk": w(H, H), "wv": w(H, H), "wo": w(H, H),
         "ln2": w.ones(H), "up": w(H, F), "down": w(F, H)} for _ in range(n_layers)], "ln_f": w.ones(H)}

    def blocks(x):  # (b, t, heads * hd) -> (b, heads, blocks, block, hd)
        return heads(x).reshape(x.shape[0], nb, block, NH, HD).transpose(0, 3, 1, 2, 4)

    def gather(x):  # (b, heads, blocks, block, hd) -> (b, heads, blocks, picks * block, hd)
        idx = jnp.broadcast_to(table.reshape(1, NH, nb * picks, 1, 1), (x.shape[0], NH, nb * picks, 1, 1))
        return jnp.take_along_axis(x, idx, axis=2).reshape(x.shape[0], NH, nb, picks * block, HD)

    def attention(lyr, x):
        q, k, v = blocks(x @ lyr["wq"]), gather(blocks(x @ lyr["wk"])), gather(blocks(x @ lyr["wv"]))
        s = jnp.where(mask, jnp.einsum("bhnqd,bhnkd->bhnqk", q, k) / np.sqrt(HD), -1e9)
        o = jnp.einsum("bhnqk,bhnkd->bhnqd", jax.nn.softmax(s, -1), v)
        return o.transpose(0, 2, 3, 1, 4).reshape(x.shape) @ lyr["wo"]

    def loss(p, batch):
        h = p["emb"][batch["inputs"]]
        for lyr in p["layers"]:
            h = h + attention(lyr, rms_norm(h, lyr["ln1"]))
            h = h + jax.nn.gelu(rms_norm(h, lyr["ln2"]) @ lyr["up"]) @ lyr["down"]
        return cross_entropy(rms_norm(h, p["ln_f"]) @ p["emb"].T, batch["targets"])

    exp = {"layers/0/wq": COL, "layers/0/wk": COL, "layers/0/wv": COL, "layers/0/wo": ROW,
           "layers/0/up": COL, "layers/0/down": ROW, "layers/0/ln1": REP, "emb": ROW}
    return Arch("block_sparse", params, loss, _tokens(), {4: exp, 2: exp})


# ---- 14. GPT-J: parallel block, interleaved rotary embedding on part of each head (HF's Flax code) --
def _sinusoidal_positions(num_pos, dim):  # transformers' Flax GPT-J, as written there
    inv_freq = 1.0 / (10000 ** (np.arange(0, dim, 2) / dim))
    sinusoid_inp = np.einsum("i , j -> i j", np.arange(num_pos), inv_freq).astype("float32")
    sin, cos = np.sin(sinusoid_inp), np.cos(sinusoid_inp)
    sentinel = dim // 2 + dim % 2
    out = np.zeros((num_pos, dim))
    out[:, 0:sentinel] = sin
    out[:, sentinel:] = cos
    return jnp.array(out)


def _rotate_every_two(tensor):  # the even and odd halves of head_dim stacked: the 'stack' primitive
    rotate_half_tensor = jnp.stack((-tensor[:, :, :, 1::2], tensor[:, :, :, ::2]), axis=-1)
    rotate_half_tensor = rotate_half_tensor.reshape(rotate_half_tensor.shape[:-2] + (-1,))
    return rotate_half_tensor


def _apply_rotary_pos_emb(tensor, sincos):
    sin_pos, cos_pos = sincos
    sin_pos = sin_pos[:, :, None, :].repeat(2, 3)
    cos_pos = cos_pos[:, :, None, :].repeat(2, 3)
    return (tensor * cos_pos) + (_rotate_every_two(tensor) * sin_pos)


def gptj_rotary(n_layers=2, seed=0, rotary_dim=2):
    """Hugging Face's Flax GPT-J (transformers 4.57): attention and MLP side by side on one norm,
    rotary embedding on the first ``rotary_dim`` of each head's dimensions, even/odd interleaved
    by ``jnp.stack``; a split on the heads must pass through the stack."""
    w = _Init(seed)
    ln = lambda: {"scale": w.ones(H), "bias": w.zeros(H)}  # noqa: E731
    params = {"transformer": {"wte": {"embedding": w(V, H)}, "h": {str(i): {
        "ln_1": ln(), "attn": {n: {"kernel": w(H, H)} for n in ("q_proj", "k_proj", "v_proj", "out_proj")},
        "mlp": {"fc_in": {"kernel": w(H, F), "bias": w.zeros(F)},
                "fc_out": {"kernel": w(F, H), "bias": w.zeros(H)}}}
        for i in range(n_layers)}, "ln_f": ln()},
        "lm_head": {"kernel": w(H, V), "bias": w.zeros(V)}}
    table = _sinusoidal_positions(2 * T, rotary_dim)

    def rotary(x, sincos):
        rot, rest = x[:, :, :, :rotary_dim], x[:, :, :, rotary_dim:]
        return jnp.concatenate([_apply_rotary_pos_emb(rot, sincos), rest], axis=-1)

    def loss(p, batch):
        t = p["transformer"]
        h = t["wte"]["embedding"][batch["inputs"]]
        sincos = jnp.split(jnp.take(table, jnp.broadcast_to(jnp.arange(T), (B, T)), axis=0), 2, axis=-1)
        for i in range(n_layers):
            blk = t["h"][str(i)]
            a = blk["attn"]
            x = layer_norm(h, **blk["ln_1"])
            q, k = (rotary(heads(x @ a[n]["kernel"]), sincos) for n in ("q_proj", "k_proj"))
            o = merge(attend(q, k, heads(x @ a["v_proj"]["kernel"]))) @ a["out_proj"]["kernel"]
            m = blk["mlp"]
            f = jax.nn.gelu(x @ m["fc_in"]["kernel"] + m["fc_in"]["bias"]) @ m["fc_out"]["kernel"]
            f = f + m["fc_out"]["bias"]
            h = h + o + f
        logits = layer_norm(h, **t["ln_f"]) @ p["lm_head"]["kernel"] + p["lm_head"]["bias"]
        return cross_entropy(logits, batch["targets"])

    b = "transformer/h/0/"
    exp = {b + "attn/q_proj/kernel": COL, b + "attn/k_proj/kernel": COL, b + "attn/v_proj/kernel": COL,
           b + "attn/out_proj/kernel": ROW, b + "mlp/fc_in/kernel": COL, b + "mlp/fc_in/bias": ROW,
           b + "mlp/fc_out/kernel": ROW, b + "mlp/fc_out/bias": REP, b + "ln_1/scale": REP,
           "transformer/wte/embedding": ROW, "lm_head/kernel": COL, "lm_head/bias": ROW}
    return Arch("gptj_rotary", params, loss, _tokens(), {4: exp, 2: exp})


# ---- 15. two towers (CLIP-style): a text and an image encoder, a contrastive loss over the batch --
PATCHES, PATCH_DIM, EMBED = 6, 12, 16


def two_tower(n_layers=2, seed=0):
    """A text tower over tokens and an image tower over patch vectors (pre-LN transformer
    layers, each tower its own weights), mean-pooled, projected and L2-normalised; the loss is
    CLIP's symmetric cross-entropy over the batch's similarity matrix. Each tower's layers are
    split as Megatron's; the projections feed a norm over their output, so they stay whole."""
    w = _Init(seed)

    def tower():
        return [{"ln1": w.ones(H), "wq": w(H, H), "wk": w(H, H), "wv": w(H, H), "wo": w(H, H),
                 "ln2": w.ones(H), "up": w(H, F), "down": w(F, H)} for _ in range(n_layers)]
    params = {"text": {"embed": w(V, H), "layers": tower(), "proj": w(H, EMBED)},
              "image": {"patch": w(PATCH_DIM, H), "pos": w(PATCHES, H), "layers": tower(),
                        "proj": w(H, EMBED)}, "scale": np.array(2.0, np.float32)}

    def encode(layers, h, causal):
        for lyr in layers:
            x = rms_norm(h, lyr["ln1"])
            h = h + merge(attend(heads(x @ lyr["wq"]), heads(x @ lyr["wk"]), heads(x @ lyr["wv"]),
                                 causal=causal)) @ lyr["wo"]
            h = h + jax.nn.gelu(rms_norm(h, lyr["ln2"]) @ lyr["up"]) @ lyr["down"]
        return h.mean(1)

    def loss(p, batch):
        text = encode(p["text"]["layers"], p["text"]["embed"][batch["inputs"]], True) @ p["text"]["proj"]
        image = batch["patches"] @ p["image"]["patch"] + p["image"]["pos"]
        image = encode(p["image"]["layers"], image, False) @ p["image"]["proj"]
        normalise = lambda e: e / jnp.linalg.norm(e, axis=-1, keepdims=True)  # noqa: E731
        logits = p["scale"] * normalise(text) @ normalise(image).T
        labels = jnp.arange(logits.shape[0])
        return (cross_entropy(logits, labels) + cross_entropy(logits.T, labels)) / 2

    rng = np.random.default_rng(seed)
    batch = {**_tokens(seed), "patches": rng.standard_normal((B, PATCHES, PATCH_DIM)).astype(np.float32)}
    exp = {}
    for t in ("text", "image"):
        exp.update({f"{t}/layers/0/wq": COL, f"{t}/layers/0/wk": COL, f"{t}/layers/0/wv": COL,
                    f"{t}/layers/0/wo": ROW, f"{t}/layers/0/up": COL, f"{t}/layers/0/down": ROW,
                    f"{t}/layers/0/ln1": REP})
    return Arch("two_tower", params, loss, batch, {4: exp, 2: exp})


# ---- 16. speech (wav2vec2-style): a convolutional feature encoder, a grouped positional conv ----
SAMPLES, FRAMES, CONV_C, POS_GROUPS = 4 * T, T, 24, 4


def speech(n_layers=2, seed=0):
    """wav2vec2's layout: raw audio through strided 1-D convolutions (a feature encoder), a
    projection to the model width, a grouped convolution over time as the positional embedding
    (added to the residual stream), post-LN transformer layers and a per-frame classifier."""
    w = _Init(seed)
    params = {"conv0": w(4, 1, CONV_C), "conv1": w(2, CONV_C, CONV_C), "fp_ln": w.ones(CONV_C),
              "fp": w(CONV_C, H), "pos_conv": w(5, H // POS_GROUPS, H),
              "layers": [{"wq": w(H, H), "wk": w(H, H), "wv": w(H, H), "wo": w(H, H), "ln1": w.ones(H),
                          "up": w(H, F), "down": w(F, H), "ln2": w.ones(H)} for _ in range(n_layers)],
              "head": w(H, V)}

    def conv(x, k, stride=1, groups=1, padding="VALID"):
        return jax.lax.conv_general_dilated(x, k, (stride,), padding, dimension_numbers=("NWC", "WIO", "NWC"),
                                            feature_group_count=groups)

    def loss(p, batch):
        x = jax.nn.gelu(conv(batch["audio"][..., None], p["conv0"], stride=2, padding=((1, 1),)))
        x = jax.nn.gelu(conv(x, p["conv1"], stride=2))  # (b, frames, CONV_C)
        h = rms_norm(x, p["fp_ln"]) @ p["fp"]
        h = h + jax.nn.gelu(conv(h, p["pos_conv"], groups=POS_GROUPS, padding="SAME"))
        for lyr in p["layers"]:
            h = rms_norm(h + merge(attend(heads(h @ lyr["wq"]), heads(h @ lyr["wk"]), heads(h @ lyr["wv"]),
                                          causal=False)) @ lyr["wo"], lyr["ln1"])
            h = rms_norm(h + jax.nn.gelu(h @ lyr["up"]) @ lyr["down"], lyr["ln2"])
        return cross_entropy(h @ p["head"], batch["targets"])

    rng = np.random.default_rng(seed)
    batch = {"audio": rng.standard_normal((B, SAMPLES)).astype(np.float32), "targets": _tokens(seed)["targets"]}
    # the feature encoder's two convolutions split Megatron-style over their channels; the
    # positional conv writes the residual stream, so it stays whole (its gradient then needs the
    # grouped-conv guard: tests/test_grouped_conv.py trains this model through the Trainer)
    exp = {"conv0": P(None, None, "mp"), "conv1": P(None, "mp"), "fp": REP, "pos_conv": REP,
           "layers/0/wq": COL, "layers/0/wk": COL, "layers/0/wv": COL, "layers/0/wo": ROW,
           "layers/0/up": COL, "layers/0/down": ROW, "layers/0/ln1": REP, "head": COL}
    return Arch("speech", params, loss, batch, {4: exp, 2: exp})


ARCHITECTURES = {f.__name__: f for f in (plain_jax, flax_linen, flax_nnx, transposed, fused_qkv, gqa, mqa,
                                         moe, encoder_decoder, scan_stacked, gpt2, bert, lora,
                                         block_sparse, gptj_rotary, two_tower, speech)}
