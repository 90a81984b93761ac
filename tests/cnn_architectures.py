"""Small convolutional networks written with flax.linen, for the convolution tensor-parallel tests.

Every builder ``make(n_blocks, ...)`` returns a :class:`CNN`: a stem convolution to 32 channels,
``n_blocks`` residual blocks at 32 channels on 16x16 images, a stride-2 block to 64 channels, then
``n_blocks`` blocks at 64 channels on 8x8, global average pooling and a dense head of 10 classes.
Two depths differ by one 32-channel and one 64-channel block (``block_activations``), which is
what the per-block traffic tests difference. BatchNorm runs in training mode (statistics of the
batch); its running statistics are held fixed outside the parameters.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

IMAGE, CLASSES, WIDTHS = 16, 10, (32, 64)


def _norm(kind, name):
    """A normalisation layer: BatchNorm (per channel), LayerNorm or GroupNorm over the channels."""
    if kind == "batch":
        return nn.BatchNorm(use_running_average=False, momentum=0.9, name=name)
    if kind == "layer":
        return nn.LayerNorm(name=name)
    if kind == "group":
        return nn.GroupNorm(num_groups=8, name=name)
    return lambda x: x


class BasicBlock(nn.Module):
    """ResNet's basic block: conv3x3 -> norm -> relu -> conv3x3 -> norm, plus the residual."""
    features: int
    strides: int = 1
    norm: str = None

    @nn.compact
    def __call__(self, x):
        bias = self.norm is None
        y = nn.Conv(self.features, (3, 3), self.strides, use_bias=bias, name="conv1")(x)
        y = nn.relu(_norm(self.norm, "norm1")(y))
        y = nn.Conv(self.features, (3, 3), use_bias=bias, name="conv2")(y)
        y = _norm(self.norm, "norm2")(y)
        if x.shape[-1] != self.features or self.strides != 1:
            x = nn.Conv(self.features, (1, 1), self.strides, use_bias=bias, name="shortcut")(x)
        return nn.relu(x + y)


class GroupedBlock(nn.Module):
    """RegNet's / ResNeXt's block: conv1x1 -> norm -> relu -> grouped conv3x3 (groups of
    ``group_width`` channels) -> norm -> relu -> conv1x1 -> norm, plus the residual."""
    features: int
    strides: int = 1
    norm: str = None
    group_width: int = 8

    @nn.compact
    def __call__(self, x):
        bias = self.norm is None
        f = self.features
        y = nn.Conv(f, (1, 1), use_bias=bias, name="reduce")(x)
        y = nn.relu(_norm(self.norm, "norm1")(y))
        y = nn.Conv(f, (3, 3), self.strides, feature_group_count=f // self.group_width,
                    use_bias=bias, name="grouped")(y)
        y = nn.relu(_norm(self.norm, "norm2")(y))
        y = nn.Conv(f, (1, 1), use_bias=bias, name="expand")(y)
        y = _norm(self.norm, "norm3")(y)
        if x.shape[-1] != f or self.strides != 1:
            x = nn.Conv(f, (1, 1), self.strides, use_bias=bias, name="shortcut")(x)
        return nn.relu(x + y)


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block (Liu et al. 2022, as its Flax ports write it): a depthwise 7x7
    convolution, LayerNorm over the channels, a 4x inverted-bottleneck MLP of two Dense layers
    with GELU, a per-channel layer scale, plus the residual. A new width or stride starts with
    ConvNeXt's downsampling layer (LayerNorm, then a stride-2 2x2 convolution)."""
    features: int
    strides: int = 1
    norm: str = None  # ConvNeXt's own LayerNorm; the argument keeps Net's signature

    @nn.compact
    def __call__(self, x):
        f = self.features
        if x.shape[-1] != f or self.strides != 1:
            x = nn.LayerNorm(name="down_norm")(x)
            x = nn.Conv(f, (self.strides, self.strides), self.strides, name="downsample")(x)
        y = nn.Conv(f, (7, 7), feature_group_count=f, name="dwconv")(x)
        y = nn.Dense(4 * f, name="pwconv1")(nn.LayerNorm(name="norm")(y))
        y = nn.Dense(f, name="pwconv2")(nn.gelu(y))
        gamma = self.param("gamma", nn.initializers.constant(0.5), (f,))
        return x + gamma * y


class Net(nn.Module):
    block: type
    n_blocks: int
    norm: str = None

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(WIDTHS[0], (3, 3), use_bias=self.norm is None, name="stem")(x)
        x = nn.relu(_norm(self.norm, "stem_norm")(x))
        for i in range(self.n_blocks):
            x = self.block(WIDTHS[0], norm=self.norm, name=f"a{i}")(x)
        x = self.block(WIDTHS[1], strides=2, norm=self.norm, name="down")(x)
        for i in range(self.n_blocks):
            x = self.block(WIDTHS[1], norm=self.norm, name=f"b{i}")(x)
        return nn.Dense(CLASSES, name="head")(x.mean((1, 2)))


@dataclasses.dataclass
class CNN:
    name: str
    model: nn.Module
    params: dict
    batch_stats: dict          # BatchNorm's running statistics (empty without BatchNorm)

    def logits(self, params, images):
        variables = {"params": params}
        if self.batch_stats:  # training mode: the batch's statistics; the running ones unused
            variables["batch_stats"] = self.batch_stats
            return self.model.apply(variables, images, mutable=["batch_stats"])[0]
        return self.model.apply(variables, images)

    def loss(self, params, batch):
        logits = self.logits(params, batch["images"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    def loss_fn(self, rng, state, params, batch, is_training):
        """The Trainer's loss_fn."""
        return self.loss(params, batch)


def examples(n, seed=0):
    """``n`` random images with labels (examples for the Trainer)."""
    rng = np.random.default_rng(seed)
    return [{"image": rng.normal(size=(IMAGE, IMAGE, 3)).astype(np.float32),
             "label": int(rng.integers(CLASSES))} for _ in range(n)]


def collate(rows):
    return {"images": np.stack([r["image"] for r in rows]),
            "labels": np.array([r["label"] for r in rows], np.int32)}


def block_activations(batch_per_device):
    """The [batch, H, W, C] output of the blocks two depths differ by (one of each stage)."""
    return [(batch_per_device, IMAGE, IMAGE, WIDTHS[0]),
            (batch_per_device, IMAGE // 2, IMAGE // 2, WIDTHS[1])]


def _build(name, block, n_blocks, norm, seed):
    model = Net(block, n_blocks, norm)
    variables = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, IMAGE, IMAGE, 3)))
    return CNN(name, model, variables["params"], variables.get("batch_stats", {}))


def resnet(n_blocks=1, norm="batch", seed=0):
    """ResNet-style basic blocks (32 then 64 channels)."""
    return _build("resnet", BasicBlock, n_blocks, norm, seed)


def regnet(n_blocks=1, norm="batch", seed=0):
    """RegNet/ResNeXt-style blocks with a grouped 3x3 convolution (groups of 8 channels: 4
    groups at 32 channels, 8 at 64)."""
    return _build("regnet", GroupedBlock, n_blocks, norm, seed)


def convnext(n_blocks=1, norm=None, seed=0):
    """ConvNeXt-style blocks (32 then 64 channels): a depthwise convolution before an MLP."""
    return _build("convnext", ConvNeXtBlock, n_blocks, norm, seed)


CNNS = {"resnet": resnet, "regnet": regnet, "convnext": convnext}
