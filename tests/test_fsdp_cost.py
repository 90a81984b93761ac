"""FSDP by cost (redcoast/layout/fsdp_cost.py): the largest tensors split over 'dp' first, as long as
their gathers stay within 2% of the step's estimated time; all of them where memory is tight."""

import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from redcoast import Deployer, Trainer
from redcoast.layout.fsdp_cost import choose_fsdp
from redcoast.layout.choice import batches_like
from redcoast.sharding.rules import Placement

F32 = np.float32


def b1_like():
    """Task B1's tensors (issue 28): embedding and head 1 MiB, 4 layers of 128-512 KiB, norms."""
    out = [Placement(("embed",), (1024, 256), F32, P(), "rep"),
           Placement(("head",), (256, 1024), F32, P(), "rep")]
    for i in range(4):
        for name, shape in (("q", (256, 256)), ("k", (256, 128)), ("v", (256, 128)),
                            ("o", (256, 256)), ("gate", (256, 512)), ("up", (256, 512)),
                            ("down", (512, 256)), ("norm", (256,))):
            out.append(Placement((str(i), name), shape, F32, P(), "rep"))
    return out


def test_the_largest_tensors_are_split_first_within_the_time_allowed():
    pls = b1_like()
    # 8 data shards on 2 cores: gathers cost ~0.4 ms each, the step ~0.45 s: some are kept
    choice = choose_fsdp(pls, {"dp": 8, "mp": 1}, "cpu", 4.4e9, n_local_devices=8)
    split = [pl for pl in pls if pl.path not in choice.keep]
    kept = [pl for pl in pls if pl.path in choice.keep]
    assert split and kept
    assert min(pl.bytes_per_device({}) for pl in split) >= max(pl.bytes_per_device({}) for pl in kept)
    assert ("embed",) not in choice.keep and ("0", "norm") in choice.keep
    assert "FSDP by cost" in choice.note and "over the 2% allowed" in choice.note


def test_a_step_long_enough_splits_everything_and_one_data_shard_nothing():
    pls = b1_like()
    assert choose_fsdp(pls, {"dp": 8, "mp": 1}, "cpu", 1e13, n_local_devices=8).keep == frozenset()
    assert choose_fsdp(pls, {"dp": 2, "mp": 4}, "gpu", 1e15, n_local_devices=8).keep == frozenset()
    assert choose_fsdp(pls, {"dp": 1, "mp": 8}, "cpu", 4.4e9, n_local_devices=8).note == ""
    # fewer devices per gather cost less: more is split over 2 data shards than over 8
    kept = lambda dp: len(choose_fsdp(pls, {"dp": dp, "mp": 8 // dp}, "cpu", 4.4e9, 8).keep)  # noqa: E731
    assert kept(2) <= kept(4) <= kept(8)


def test_a_state_filling_half_a_device_is_split_whatever_the_time():
    pls = b1_like()
    slow = choose_fsdp(pls, {"dp": 8, "mp": 1}, "cpu", 4.4e9, n_local_devices=8)
    assert slow.keep
    tight = choose_fsdp(pls, {"dp": 8, "mp": 1}, "cpu", 4.4e9, n_local_devices=8,
                        budget_bytes=40 * 2**20)  # 3 x 11.5 MiB of state: over half of 40 MiB
    assert tight.keep == frozenset() and "over 50% of the device's" in tight.note


def test_the_trainer_default_splits_by_cost_and_says_so():
    # a 15 k-parameter model: its step is far shorter than the gathers would be, so nothing is
    # split over 'dp' (the plan is fsdp=False's) and the table says why; nothing compiled to choose
    from tiny_lm import collate_fn, loss_fn, make_examples, make_model

    model, params = make_model()
    batch = collate_fn(make_examples(8))

    def plan(**options):  # the layout settled as at the first batch, nothing compiled
        trainer = Trainer(Deployer(n_model_shards=2, verbose=False), collate_fn, model.apply,
                          loss_fn, params, optax.adamw(1e-3), **options)
        trainer._settle_layout(batches_like(batch, 1, trainer.layout.n_data_shards))
        return trainer

    default = plan()
    assert default.layout.candidate.fsdp == "by cost" and not default.layout.considered
    table = default.plan.table()
    assert "FSDP by cost: 0 of" in table and "over the 2% allowed" in table
    assert [pl.spec for pl in default.plan.placements] == [
        pl.spec for pl in plan(fsdp=False).plan.placements]


def test_every_process_takes_process_0s_choice(monkeypatch):
    # hosts of different sizes estimate differently; the plan must be one: process 0's mask of
    # kept tensors is broadcast (the real broadcast runs in tests/test_multiprocess.py)
    import jax
    from jax.experimental import multihost_utils

    from redcoast.layout.fsdp_cost import FsdpChoice, agreed_by_all_processes

    paths = [("a",), ("b",), ("c",)]
    mine = FsdpChoice(frozenset({("c",)}), "FSDP by cost: 2 of 3")
    assert agreed_by_all_processes(mine, paths) is mine  # one process: as it is
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    sent = []
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all",
                        lambda x: sent.append(x.tolist()) or np.array([0, 1, 1], np.int32))
    got = agreed_by_all_processes(mine, paths)
    assert sent == [[0, 0, 1]]
    assert got.keep == {("b",), ("c",)} and "process 0's choice" in got.note
