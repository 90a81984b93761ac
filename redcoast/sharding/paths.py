"""Leaf paths of a pytree as tuples of strings, in the order the user wrote them."""

from collections.abc import Mapping

import jax


def key_to_str(key):
    """One entry of a JAX key path as a plain string ('Dense_0', '0', 'mu', ...)."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_to_tuple(key_path):
    return tuple(key_to_str(k) for k in key_path)


def path_to_str(path):
    return "/".join(path)


def leaves_with_paths(tree):
    """``[(path tuple, leaf)]`` in ``jax.tree_util`` flatten order (dict keys sorted)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(path_to_tuple(kp), leaf) for kp, leaf in flat]


def leaves_in_written_order(tree, prefix=()):
    """``[(path tuple, leaf)]`` with dicts walked in insertion order.

    Flax and plain-dict params keep the order in which layers were created, which is the order
    of the forward pass; ``jax.tree_util`` sorts dict keys and would lose it.
    """
    if isinstance(tree, Mapping):
        out = []
        for key, child in tree.items():
            out.extend(leaves_in_written_order(child, prefix + (str(key),)))
        return out
    children, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda node: node is not tree)
    if len(children) == 1 and children[0][1] is tree:  # a leaf
        return [(prefix, tree)]
    out = []
    for key_path, child in children:
        out.extend(leaves_in_written_order(child, prefix + path_to_tuple(key_path)))
    return out
