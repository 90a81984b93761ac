"""Trees of ``jax.ShapeDtypeStruct``: a model's parameters known by shape alone.

A Trainer built from such parameters plans its layout and compiles its step (memory, cost,
collectives) without allocating a parameter; ``set_params`` makes it concrete.
"""

import jax

from ..errors import ConfigError


def is_abstract(tree):
    """Whether ``tree``'s leaves are all ``jax.ShapeDtypeStruct`` (False for a tree of arrays);
    a tree that mixes both is an error."""
    leaves = jax.tree_util.tree_leaves(tree)
    abstract = [isinstance(x, jax.ShapeDtypeStruct) for x in leaves]
    if any(abstract) and not all(abstract):
        raise ConfigError("params mix jax.ShapeDtypeStruct leaves with arrays. Fix: give every "
                          "leaf as an array (to train) or every leaf as a ShapeDtypeStruct (to "
                          "plan and compile without allocating, e.g. model.abstract_params()).")
    return bool(leaves) and all(abstract)


def placed(tree, shardings):
    """``tree``'s shapes and dtypes with ``shardings`` (a tree of the same structure)."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def shapes_of(fn, tree, shardings):
    """What ``fn(tree)`` returns, as shapes placed by ``shardings``: ``fn`` is not run."""
    return placed(jax.eval_shape(fn, tree), shardings)
