"""A Flax NNX module seen the way redcoast's core sees every model: a params pytree and a pure
``apply`` function.

The params are a plain nested dict of arrays with string keys (list indices become "0", "1",
...), so they checkpoint, export and shard like any user model's; ``apply(params, *args)``
rebuilds the module from them inside the traced function, so it can be jitted, differentiated
and sharded. Nothing is allocated to build a :class:`Model`: the module is created abstractly.
"""

import jax
import jax.numpy as jnp
from flax import nnx


# The compiler options of a program that draws fresh parameters. XLA:GPU's multi-output fusion
# puts every parameter of one shape into one kernel (a 22-layer Llama: 44 copies of the random
# generator and its normal transform in the gate/up projections' kernel), and the GPU assembler's
# time grows faster than the kernel's length: TinyLlama-1.1B's init compiled in 164 s on an H200
# (jax 0.11.2), against 25 s for its training step; for an H100 with that pass off, 31 s instead
# of 188 (compile-only, jax 0.10.2); 24 s on the H200. Each kernel then computes one parameter,
# the same numbers (bit for bit on XLA:CPU and on the H200). The TPU compiler takes the option
# too (libtpu 0.0.42.1). The init runs once, so its kernels' speed does not matter.
INIT_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "multi_output_fusion"}


def _str_keys(tree):
    if isinstance(tree, dict):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


def _module_keys(tree, template):
    """``tree``'s keys turned back into the key types of ``template`` (ints for list items)."""
    if not isinstance(template, dict):
        return tree
    by_str = {str(k): k for k in template}
    out = {}
    for key, value in tree.items():
        if key not in by_str:
            raise KeyError(f"unexpected parameter {key!r}; expected one of {sorted(by_str)}")
        out[by_str[key]] = _module_keys(value, template[by_str[key]])
    return out


class Model:
    """``module_cls(config, rngs=...)`` as params + apply.

    ``model.apply(params, *args, method=None, **kwargs)`` calls the module (or its method named
    ``method``) with the given parameters; ``model.init(seed)`` makes fresh random parameters;
    ``model.abstract_params()`` gives their shapes and dtypes without allocating anything.
    """

    def __init__(self, module_cls, config, param_dtype=jnp.float32):
        self.module_cls = module_cls
        self.config = config
        self.param_dtype = param_dtype
        self.generation_config = {}  # generate()'s defaults (generation_config.json), if any
        self.chat_template = None    # the model's own ChatTemplate (models/chat_template.py), if any
        self.name_or_path = None     # the folder it was read from, if any (PEFT's base model)
        self._module = nnx.eval_shape(lambda: self._build(0))
        self.graphdef, self._params_state, self._rest_state = nnx.split(self._module, nnx.Param, ...)
        self._template = nnx.to_pure_dict(self._params_state)

    def _build(self, seed):
        return self.module_cls(self.config, rngs=nnx.Rngs(seed), param_dtype=self.param_dtype)

    def abstract_params(self):
        """The params' shapes and dtypes (``jax.ShapeDtypeStruct`` leaves), nothing allocated."""
        return _str_keys(jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self._template))

    def init(self, seed=0, out_shardings=None):
        """Fresh random parameters (the module's own initialisers), optionally placed sharded."""
        return self.init_program(seed, out_shardings)()

    def init_program(self, seed=0, out_shardings=None, *, compiler_options=None):
        """The jitted program :meth:`init` runs (to lower or compile it for other devices),
        compiled with ``compiler_options`` (default :data:`INIT_COMPILER_OPTIONS`; ``{}``: XLA's
        own)."""
        def make():
            _, state, _ = nnx.split(self._build(seed), nnx.Param, ...)
            return _str_keys(nnx.to_pure_dict(state))
        options = INIT_COMPILER_OPTIONS if compiler_options is None else compiler_options
        return jax.jit(make, out_shardings=out_shardings, compiler_options=options)

    def bind(self, params):
        """The module with ``params`` in it (for use inside a traced function)."""
        state = jax.tree_util.tree_map(lambda v: v, self._params_state)  # a fresh copy to fill
        nnx.replace_by_pure_dict(state, _module_keys(params, self._template))
        return nnx.merge(self.graphdef, state, self._rest_state)

    def apply(self, params, *args, method=None, **kwargs):
        module = self.bind(params)
        fn = module if method is None else getattr(module, method)
        return fn(*args, **kwargs)

    def __getattr__(self, name):
        # Methods that need no parameters (e.g. ``init_cache``) are reached on the abstract module.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._module, name)

    def __repr__(self):
        return f"Model({self.module_cls.__name__}, {self.config!r})"
