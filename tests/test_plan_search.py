"""The plan's search (redcoast/cli/plan_search.py): candidates, their estimated step time, the order
they are compiled in, when the search stops, and the suggestions when nothing fits; compile
results stubbed, so each test takes milliseconds."""

import dataclasses
import math

import pytest

from redcoast.cli import plan_search
from redcoast.cli.plan_search import Candidate, ModelShape, Rates, Run, Shortfall

GIB = 2**30
RATES = Rates(peak_flops=1e15, within=400e9, across=50e9, source="test")


def test_candidates_are_the_shards_dividing_a_host_remat_and_scan_less_what_is_pinned():
    found = plan_search.candidates(64, 8, scannable=True)
    assert {c.model_shards for c in found} == {1, 2, 4, 8}  # not 16, 32, 64: within a host
    assert len(found) == 4 * 2 * 2
    assert {c.scan for c in plan_search.candidates(8, 1, scannable=False)} == {False}
    pinned = plan_search.candidates(8, 1, model_shards=1, remat=True, scan=False, scannable=True)
    assert pinned == [Candidate(1, True, False)]
    assert {c.model_shards for c in plan_search.candidates(12, 2)} == {1, 2, 3, 6}


def test_the_estimate_is_flops_over_the_peak_plus_bytes_over_the_links():
    model = ModelShape(n_params=10**9, layers=10, hidden=1000, param_itemsize=4)
    run = Run(devices=8, hosts=1, seq_len=100, per_device_batch_size=2)
    # FSDP over 8: 16 examples, (6N + 12 L h s) a token; weights 3 times round an 8-ring
    e = plan_search.estimate(Candidate(1, False, False), model, run, RATES)
    flops = (6e9 + 12 * 10 * 1000 * 100) * 16 * 100 / 8
    assert e.examples == 16 and e.model_flops_per_device == pytest.approx(flops)
    assert e.compute_seconds == pytest.approx(flops / 1e15)
    assert e.comm_seconds == pytest.approx(3 * 4e9 * 7 / 8 / 400e9)
    assert e.mfu == pytest.approx(e.compute_seconds / e.seconds)
    # remat recomputes the forward: 4/3 of the FLOPs, the model FLOPs (and so MFU's) unchanged
    r = plan_search.estimate(Candidate(1, True, False), model, run, RATES)
    assert r.compute_seconds == pytest.approx(e.compute_seconds * 4 / 3)
    assert r.model_flops_per_device == e.model_flops_per_device
    # tensor parallel over 8: one data shard, 4 all-reduces of [2, 100, 1000] fp32 a layer
    t = plan_search.estimate(Candidate(8, False, False), model, run, RATES)
    assert t.examples == 2 and t.comm_seconds == pytest.approx(
        10 * 4 * 2 * 7 / 8 * 2 * 100 * 1000 * 4 / 400e9)
    # across hosts, FSDP's ring runs at the network's rate
    two = plan_search.estimate(Candidate(1, False, False), model,
                               dataclasses.replace(run, hosts=2), RATES)
    assert two.comm_seconds == pytest.approx(3 * 4e9 * 7 / 8 / 50e9)


@dataclasses.dataclass
class Stub:
    fits: bool
    compile_seconds: float
    per_device_peak_bytes: int


def _search(verdicts, cands, seconds):
    """The search over ``cands`` with ``seconds`` per example each and ``verdicts`` (a dict
    candidate -> Stub) as the compiler's answers; also the candidates compiled, in order."""
    compiled = []

    def attempt(c):
        compiled.append(c)
        answer = verdicts[c]
        if isinstance(answer, Exception):
            raise answer
        return answer
    estimates = [plan_search.StepEstimate(s, 0.0, 1, 1.0, 1.0) for s in seconds]
    outcomes, chosen = plan_search.search(cands, estimates, attempt, 8)
    return outcomes, chosen, compiled


def test_the_search_compiles_fastest_first_and_stops_at_the_first_that_fits():
    cands = plan_search.candidates(8, 1, model_shards=None, scannable=True)
    fits = Stub(True, 1.0, 40 * GIB)
    over = Stub(False, 1.0, 90 * GIB)
    # mp=8 fastest by estimate; its scanned step (no remat) does not fit, the remat one does
    seconds = [1.0 + (8 - c.model_shards) + (0.5 if c.remat else 0) for c in cands]
    verdicts = {c: over for c in cands}
    verdicts[Candidate(8, True, True)] = fits
    outcomes, chosen, compiled = _search(verdicts, cands, seconds)
    # scanned first at equal estimates; unrolled mp=8 no remat skipped (scanned needs no more)
    assert compiled == [Candidate(8, False, True), Candidate(8, True, True)]
    assert outcomes[chosen].candidate == Candidate(8, True, True)
    by = {o.candidate: o for o in outcomes}
    assert by[Candidate(8, False, False)].status == "not compiled"
    assert "needs at least the memory of dp=1 x mp=8, scanned" in by[Candidate(8, False, False)].why
    assert by[Candidate(8, False, True)].status == "DOES NOT FIT"
    assert "1.00x" in by[Candidate(8, True, False)].why  # as fast, not tried: one fits
    assert "which fits" in by[Candidate(1, False, True)].why


def test_a_state_over_the_device_skips_the_other_tries_of_those_shards_and_errors_are_said():
    cands = plan_search.candidates(8, 1, scan=False)
    state = Stub(False, 0.0, 200 * GIB)  # not compiled: the state alone
    verdicts = {c: (state if c.model_shards == 1 else ValueError("sharding bug\nmore"))
                for c in cands}
    verdicts[Candidate(8, False, False)] = Stub(True, 2.0, 70 * GIB)
    seconds = [{1: 1, 2: 2, 4: 3, 8: 4}[c.model_shards] + c.remat for c in cands]
    outcomes, chosen, compiled = _search(verdicts, cands, seconds)
    assert Candidate(1, True, False) not in compiled  # same shards: same state
    by = {o.candidate: o for o in outcomes}
    assert "state alone exceeds the device (200.00 GiB)" in by[Candidate(1, True, False)].why
    assert by[Candidate(2, False, False)].status == "ERROR"
    assert by[Candidate(2, False, False)].why == "sharding bug"
    assert outcomes[chosen].candidate == Candidate(8, False, False)


def test_nothing_fits_the_closest_is_the_smallest_compiled():
    cands = plan_search.candidates(8, 1, model_shards=8, scan=False)
    verdicts = {Candidate(8, False, False): Stub(False, 1.0, 90 * GIB),
                Candidate(8, True, False): Stub(False, 1.0, 85 * GIB)}
    outcomes, chosen, _ = _search(verdicts, cands, [1.0, 1.3])
    assert chosen is None
    assert plan_search.smallest(outcomes).candidate == Candidate(8, True, False)


def _shortfall(**change):
    base = dict(params=10 * GIB, optimizer=20 * GIB, gradients=10 * GIB, temporaries=70 * GIB,
                memory=80 * GIB, devices=8, hosts=1, seq_len=4096, model_shards=1,
                param_dtype="float32", optimizer_name="adamw", adafactor_bytes=8 * GIB)
    return Shortfall(**{**base, **change})


def test_what_would_fit_is_computed():
    advice = plan_search.suggest(_shortfall())
    # activations 60 GiB; 40 GiB of state a device x 8 devices over the 20 GiB left: 16 devices
    assert advice[0].startswith("16 devices of this memory (2 hosts of 8)")
    # bf16: (40 + 60) / 2 = 50 GiB; Adafactor: 10 + 1 + 10 + 60 = 81 GiB
    assert "bfloat16" in advice[1] and "would fit (estimated peak 50.00 GiB" in advice[1]
    assert "adafactor" in advice[2] and "would still not fit (estimated peak 81.00 GiB" in advice[2]
    # one compile: activations taken as proportional: 40 GiB of room / 60 -> 2730 -> 2688
    assert advice[3].startswith("--seq-len 2688 or shorter") and "an estimate" in advice[3]


def test_a_shorter_sequence_from_how_two_compiles_scaled():
    # activations 60 GiB at 4096, 15 GiB at 2048: quadratic, so 40 GiB of room -> 4096 sqrt(2/3)
    s = _shortfall(half_seq_temporaries=15 * GIB + 10 * GIB)
    text = [a for a in plan_search.suggest(s) if "--seq-len" in a][0]
    assert "seq^2.00" in text
    seq = int(4096 * math.sqrt(40 / 60)) // 128 * 128
    assert text.startswith(f"--seq-len {seq} or shorter")


def test_when_the_state_alone_exceeds_the_device_more_devices_and_what_halves_it():
    s = _shortfall(params=50 * GIB, optimizer=100 * GIB, gradients=50 * GIB, temporaries=None)
    advice = plan_search.suggest(s)
    # 200 GiB x 8 over 80% of 80 GiB: 25 -> whole hosts of 8: 32
    assert advice[0].startswith("32 devices of this memory (4 hosts of 8)")
    assert "estimated state 100.00 GiB" in advice[1] and "would still not fit" in advice[1]
    assert not any("--seq-len" in a for a in advice)  # nothing compiled, nothing said of it


def test_more_model_shards_where_the_user_pinned_fewer():
    advice = plan_search.suggest(_shortfall(larger_shards=(2, 4, 8), remat_pinned_off=True))
    shards = [a for a in advice if a.startswith("--model-shards")]
    # state 40 + activations 60 / 8 = 47.5 GiB
    assert shards[-1].startswith("--model-shards 8") and "47.50 GiB" in shards[-1]
    # 40 + 60 / 2 = 70 GiB: two shards are enough
    assert shards[0].startswith("--model-shards 2")
    assert "would fit (estimated peak 70.00" in shards[0]
    assert any(a.startswith("--remat") for a in advice)
