"""What a compiled training step should cost, from XLA's own analyses of it.

A candidate layout's step (layout.py) is compiled for the first batch; XLA's memory analysis says
whether it fits a device, and this cost model says how long it should take:

    seconds = flops / flop_rate + bytes accessed / memory_rate
              + sum over collectives (latency + wire bytes / link_rate)

with per-platform rates (``RATES``). Among the candidates that fit, the cheapest wins; a candidate
within ``TIE`` of the cheapest that needs less memory is preferred (same speed, more room).
Candidates with different numbers of model shards train different global batches per step
(``n_model_shards='auto'``), so they are compared per example.
"""

import dataclasses

from ..sharding.axes import DATA_AXIS
from ..sharding.dataflow import LinkCosts
from .comms import collective_report

# Rates per platform (per device). CPU: simulated devices share the host's cores and XLA's CPU
# collectives rendezvous threads and reduce on one of them, so a collective byte costs far more
# than a byte of compute: fitted to the step-time differences of fused against unfused steps of
# benchmarks/defaults_vs_hand.py (4x2: -6.3 MB wire, -0.23 s; 1x8: -24 MB, -0.8 GFLOP, -0.7 s on a
# loaded 2-core host). Accelerators: nominal figures (device memory vs links), not fitted.
RATES = {
    "cpu": dict(flop_rate=2e10, memory_rate=1e10, link_rate=3e7, latency=2e-4),
    "gpu": dict(flop_rate=2e14, memory_rate=2e12, link_rate=1e11, latency=1e-5),
    "tpu": dict(flop_rate=2e14, memory_rate=1e12, link_rate=1e11, latency=1e-5),
}
TIE = 0.01


def flops_per_link_byte(mesh):
    """How many FLOPs one byte between devices costs on ``mesh``'s platform (its ``RATES``)."""
    return link_costs(mesh).flops_per_byte


def link_costs(mesh):
    """The LinkCosts of ``mesh`` (a byte and a collective in FLOPs, at its platform's
    ``RATES``; its data shards) that the data-flow analysis weighs a recurrent cell's split by."""
    r = RATES.get(mesh.devices.flat[0].platform, RATES["gpu"])
    return LinkCosts(r["flop_rate"] / r["link_rate"], r["latency"] * r["flop_rate"],
                     mesh.shape.get(DATA_AXIS, 1))


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What the compiled step of one candidate costs, from XLA's analyses."""
    memory_bytes: int       # peak bytes per device (arguments + outputs - aliased + temporaries)
    flops: float
    bytes_accessed: float
    collectives: int        # per step
    wire_bytes: float       # per device per step
    seconds: float          # the cost model's estimate
    examples: int = 1       # examples one step trains on (its global batch)

    @property
    def seconds_per_example(self):
        return self.seconds / self.examples


def estimate(compiled, mesh, platform, examples=1):
    """The :class:`Estimate` of a compiled step on ``mesh`` training ``examples`` per step."""
    m = compiled.memory_analysis()
    memory = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
              + m.temp_size_in_bytes)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    report = collective_report(compiled, mesh)
    count, wire = report.count(), float(report.wire_bytes())
    r = RATES.get(platform, RATES["gpu"])
    seconds = (flops / r["flop_rate"] + accessed / r["memory_rate"]
               + count * r["latency"] + wire / r["link_rate"])
    return Estimate(int(memory), flops, accessed, int(count), wire, seconds, int(examples))


def choose(estimates, budget_bytes):
    """(index of the chosen estimate, why). The cheapest that fits ``budget_bytes``; within
    ``TIE`` of it, the one needing least memory. None of them fitting: the smallest."""
    fits = [i for i, e in enumerate(estimates) if e.memory_bytes <= budget_bytes]
    if not fits:
        i = min(range(len(estimates)), key=lambda j: estimates[j].memory_bytes)
        return i, (f"none fits the budget of {mib(budget_bytes)} per device; the smallest "
                   f"({mib(estimates[i].memory_bytes)})")
    cost = [e.seconds_per_example for e in estimates]
    cheapest = min(fits, key=lambda j: cost[j])
    near = [j for j in fits if cost[j] <= cost[cheapest] * (1 + TIE)]
    i = min(near, key=lambda j: (estimates[j].memory_bytes, cost[j]))
    if i == cheapest:
        return i, "the lowest estimated time per example among those that fit"
    return i, (f"within {TIE:.0%} of the lowest estimated time per example and "
               f"{mib(estimates[cheapest].memory_bytes - estimates[i].memory_bytes)} less memory")


def format_table(candidates, estimates, chosen, budget_bytes):
    """One line per candidate: memory, the cost model's inputs and estimate, which was chosen."""
    lines = [f"{'candidate':<36}{'memory/dev':>12}{'GFLOP':>9}{'MB accessed':>13}"
             f"{'collectives':>12}{'wire MB':>9}{'est. ms':>9}{'us/example':>11}"]
    for i, (c, e) in enumerate(zip(candidates, estimates)):
        mark = "  <- chosen" if i == chosen else ("  (over budget)" if e.memory_bytes > budget_bytes else "")
        lines.append(f"{c.name:<36}{mib(e.memory_bytes):>12}{e.flops / 1e9:>9.2f}"
                     f"{e.bytes_accessed / 1e6:>13.1f}{e.collectives:>12}{e.wire_bytes / 1e6:>9.2f}"
                     f"{e.seconds * 1e3:>9.2f}{e.seconds_per_example * 1e6:>11.1f}{mark}")
    return "\n".join(lines)


def mib(n):
    """``n`` bytes as MiB, for messages."""
    return f"{n / 2**20:.2f} MiB"
