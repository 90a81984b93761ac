"""The layout ``redcoast plan`` chooses: model shards, remat and scanned layers searched as a user
would, the fastest by estimate that the compiler says fits.

Every candidate (model shards dividing a host's devices x remat on/off x layers scanned or
unrolled, less what the user pinned) gets an estimated step time before anything is compiled;
they are compiled in that order and the first that fits is the answer, so one compile usually
settles it. A candidate is not compiled when one needing no more memory already failed (same
model shards, with remat and/or scanned where it is not) or when its state alone exceeds the
device. The estimate (an estimate, not a measurement; it ranks layouts):

    seconds = model FLOPs per device (x 4/3 with remat) / the device's peak
              + FSDP's bytes (weights gathered forward and backward, gradients reduce-scattered)
                / the data-parallel link + tensor parallelism's activation all-reduces / NVLink

with model FLOPs per token 6N + 12 L h s (PaLM, N all parameters) and the links of ``RATES``.
Candidates train different global batches (per-device batch x data shards), so they are ranked
per example, as the Trainer's ``n_model_shards='auto'`` does (cost_model.py).
"""

import dataclasses
import math

GB = 1e9

# Per device, bytes a second one way; peaks come from throughput.PEAK_TFLOPS by the GPU's name.
# within: to the devices of its host (GPUs: NVLink); across: to other hosts (GPUs: the network).
RATES = {
    "h100": dict(within=450 * GB, across=50 * GB, source=(
        "NVLink 4: 900 GB/s a GPU both ways (NVIDIA H100 datasheet); 400 Gb/s ConnectX-7 "
        "InfiniBand a GPU (NVIDIA DGX H100 user guide)")),
    "h200": dict(within=450 * GB, across=50 * GB, source=(
        "NVLink 4: 900 GB/s a GPU both ways (NVIDIA H200 datasheet); 400 Gb/s ConnectX-7 "
        "InfiniBand a GPU (NVIDIA DGX H200)")),
    "a100": dict(within=300 * GB, across=25 * GB, source=(
        "NVLink 3: 600 GB/s a GPU both ways (NVIDIA A100 datasheet); 200 Gb/s HDR InfiniBand "
        "a GPU (NVIDIA DGX A100 user guide)")),
    "a100-40gb": dict(within=300 * GB, across=25 * GB, source=(
        "NVLink 3: 600 GB/s a GPU both ways (NVIDIA A100 datasheet); 200 Gb/s HDR InfiniBand "
        "a GPU (NVIDIA DGX A100 user guide)")),
    "tpu-v4": dict(within=268 * GB, across=268 * GB, peak=275e12, source=(
        "ICI: 1.1 PB/s all-reduce bandwidth a 4096-chip pod, 268 GB/s a chip; 275 TFLOP/s a "
        "chip, float32 matmuls in bfloat16 passes by default (Cloud TPU v4 documentation)")),
    "cpu": dict(within=100 * GB, across=25 * GB, peak=200e12, source=(
        "no target named: a nominal accelerator (200 TFLOP/s, 100 GB/s within a host, 25 GB/s "
        "across), for ranking only; --target h100 etc. for a GPU's figures")),
}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout to try: model shards (tensor parallel within a host), remat, scanned layers."""
    model_shards: int
    remat: bool
    scan: bool

    def describe(self, devices):
        return (f"dp={devices // self.model_shards} x mp={self.model_shards}"
                + (", remat" if self.remat else "") + (", scanned" if self.scan else ""))

    def needs_no_more_memory_than(self, other):
        """Whether this candidate's step needs at most ``other``'s memory: the same shards, and
        remat and scanning wherever ``other`` has them (each only frees memory)."""
        return (self.model_shards == other.model_shards and self.remat >= other.remat
                and self.scan >= other.scan)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the estimate reads of a model: its parameters, depth, width, parameter bytes."""
    n_params: int
    layers: int
    hidden: int
    param_itemsize: int


@dataclasses.dataclass(frozen=True)
class Run:
    """What the estimate reads of a run: the devices, hosts, sequence and per-device batch."""
    devices: int
    hosts: int
    seq_len: int
    per_device_batch_size: int


@dataclasses.dataclass(frozen=True)
class Rates:
    """A device's peak FLOP/s and its links (bytes/s one way), with where they come from."""
    peak_flops: float
    within: float
    across: float
    source: str
    peak_known: bool = True  # False: a nominal figure, so no MFU is given


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """A candidate's estimated step: seconds (compute + communication), examples it trains."""
    compute_seconds: float
    comm_seconds: float
    examples: int
    model_flops_per_device: float   # 6N + 12 L h s per token, without remat's recomputation
    peak_flops: float

    @property
    def seconds(self):
        return self.compute_seconds + self.comm_seconds

    @property
    def seconds_per_example(self):
        return self.seconds / self.examples

    @property
    def mfu(self):
        return self.model_flops_per_device / (self.seconds * self.peak_flops)


def rates_for(target, param_dtype, device_kind=None):
    """:class:`Rates` for ``target`` ('cpu', 'tpu-v4' or a GPU of redcoast/cli/targets) computing in
    ``param_dtype``; a GPU's peak from throughput.PEAK_TFLOPS by its ``device_kind``."""
    r = RATES[target]
    if "peak" in r:
        return Rates(r["peak"], r["within"], r["across"], r["source"], target != "cpu")
    from ..layout.throughput import PEAK_TFLOPS
    import re
    sixteen = param_dtype in ("bfloat16", "float16")
    for pattern, half, single in PEAK_TFLOPS:
        if re.search(pattern, device_kind or ""):
            peak = half if sixteen else single
            return Rates(peak * 1e12, r["within"], r["across"], r["source"] + (
                f"; peak {peak:g} TFLOP/s dense ({'16-bit' if sixteen else 'TF32'}, "
                "redcoast.layout.throughput.PEAK_TFLOPS)"))
    raise KeyError(f"no peak FLOP/s for {device_kind!r} (redcoast.layout.throughput.PEAK_TFLOPS)")


def estimate(candidate, model, run, rates):
    """The :class:`StepEstimate` of ``candidate`` for ``model`` on ``run``."""
    mp = candidate.model_shards
    dp = run.devices // mp
    examples = run.per_device_batch_size * dp
    tokens = examples * run.seq_len
    per_token = 6 * model.n_params + 12 * model.layers * model.hidden * run.seq_len
    model_flops = per_token * tokens / run.devices
    compute = model_flops * (4 / 3 if candidate.remat else 1) / rates.peak_flops
    comm = 0.0
    if dp > 1:  # FSDP over dp: each device's 1/mp slice of the weights, 3 times round the ring
        link = rates.across if run.hosts > 1 else rates.within
        comm += 3 * model.n_params * model.param_itemsize / mp * (dp - 1) / dp / link
    if mp > 1:  # Megatron: 2 all-reduces of [rows, seq, hidden] a layer forward, 2 backward
        all_reduces = model.layers * (4 + (2 if candidate.remat else 0))
        size = run.per_device_batch_size * run.seq_len * model.hidden * model.param_itemsize
        comm += all_reduces * 2 * (mp - 1) / mp * size / rates.within
    return StepEstimate(compute, comm, examples, model_flops, rates.peak_flops)


def candidates(devices, hosts, model_shards=None, remat=None, scan=None, scannable=False):
    """Every :class:`Candidate` the search may try: model shards dividing a host's devices (or
    ``model_shards``), remat off and on (or ``remat``), scanned and unrolled where the family can
    scan (or ``scan``)."""
    per_host = devices // hosts
    shards = [model_shards] if model_shards else [d for d in range(1, per_host + 1)
                                                 if per_host % d == 0]
    remats = [remat] if remat is not None else [False, True]
    scans = [scan] if scan is not None else ([True, False] if scannable else [False])
    return [Candidate(m, r, s) for m in shards for r in remats for s in scans]


def ordered(cands, estimates):
    """``cands`` fastest first by estimate; at equal estimates scanned first (it compiles one
    layer, and needs no more memory), then fewer model shards."""
    return sorted(range(len(cands)), key=lambda i: (round(estimates[i].seconds_per_example, 12),
                                                      not cands[i].scan, cands[i].model_shards))


@dataclasses.dataclass
class Outcome:
    """What became of one candidate in the search."""
    candidate: Candidate
    estimate: StepEstimate
    record: object = None     # the attempt's record (compiled or refused for its state) or None
    status: str = "not compiled"
    why: str = ""
    error: Exception | None = None   # what stopped this candidate compiling, if anything

    @property
    def compiled(self):
        return self.record is not None and self.record.compile_seconds > 0


def search(cands, estimates, attempt, devices, is_failure=lambda e: True):
    """``(outcomes in the order tried, index of the chosen outcome or None)``: ``attempt(c)``
    returns a record (``fits``, ``compile_seconds``: 0 when the state alone exceeds the device,
    ``per_device_peak_bytes``) for each candidate compiled, in :func:`ordered` order, until one
    fits. A candidate whose attempt raises an error ``is_failure`` accepts is marked ERROR with
    the reason and the search goes on (the caller raises when no candidate got a verdict)."""
    outcomes = [Outcome(cands[i], estimates[i]) for i in ordered(cands, estimates)]
    over_by_state = {}
    chosen = None
    for k, o in enumerate(outcomes):
        c = o.candidate
        if chosen is not None:
            best = outcomes[chosen]
            ratio = o.estimate.seconds_per_example / best.estimate.seconds_per_example
            o.why = (f"estimated {ratio:.2f}x the time per example of "
                     f"{best.candidate.describe(devices)}, which fits")
            continue
        if c.model_shards in over_by_state:
            o.status, o.why = "not compiled", (f"the training state alone exceeds the device "
                                               f"({over_by_state[c.model_shards]})")
            continue
        failed = [p for p in outcomes[:k] if p.compiled and not p.record.fits
                  and p.candidate.needs_no_more_memory_than(c)]
        if failed:
            o.why = (f"needs at least the memory of {failed[0].candidate.describe(devices)}, "
                     "which does not fit")
            continue
        try:
            o.record = attempt(c)
        except Exception as e:  # noqa: BLE001 - a layout's own failure, said in the table
            if not is_failure(e):
                raise
            o.status, o.error = "ERROR", e
            o.why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            continue
        if not o.compiled:
            over_by_state[c.model_shards] = size_text(o.record.per_device_peak_bytes)
            o.status, o.why = "not compiled", (f"the training state alone exceeds the device "
                                               f"({over_by_state[c.model_shards]})")
        elif o.record.fits:
            o.status, chosen = "FITS", k
            o.why = "chosen: the fastest by estimate of those that fit"
        else:
            o.status = "DOES NOT FIT"
            o.why = f"peak {size_text(o.record.per_device_peak_bytes)} over the device's memory"
    return outcomes, chosen


def smallest(outcomes):
    """The outcome whose record needs least memory (compiled ones first), for a plan where
    nothing fits."""
    tried = [o for o in outcomes if o.record is not None]
    return min(tried, key=lambda o: (not o.compiled, o.record.per_device_peak_bytes))


def size_text(n):
    """Bytes as people read them (GiB, MiB or KiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def seconds(t):
    """A duration as people read it."""
    return f"{t:.2f} s" if t >= 1 else f"{t * 1e3:.1f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} us"


@dataclasses.dataclass(frozen=True)
class Shortfall:
    """What a plan that does not fit knows, per device in bytes, for :func:`suggest`."""
    params: int
    optimizer: int
    gradients: int
    temporaries: int | None  # the compiler's (gradients in flight among them); None: not compiled
    memory: int
    devices: int
    hosts: int
    seq_len: int
    model_shards: int
    param_dtype: str
    optimizer_name: str
    adafactor_bytes: int         # Adafactor's state for these parameters, over all devices
    half_seq_temporaries: int | None = None   # temporaries compiled at seq_len // 2, if any
    larger_shards: tuple = ()    # model shard counts the search did not try (the user pinned)
    remat_pinned_off: bool = False
    scan_pinned_off: bool = False


def suggest(s):
    """What would fit, each computed from ``s`` (a :class:`Shortfall`): more devices (how many),
    bfloat16, Adafactor, a shorter sequence, more model shards, remat or scan where pinned off."""
    state = s.params + s.optimizer + s.gradients
    # activations: the temporaries less the gradients in flight (those shrink with the state)
    act = None if s.temporaries is None else max(0, s.temporaries - s.gradients)
    room = s.memory - (act or 0)
    out = []
    per_host = s.devices // s.hosts
    usable = room if act is not None else 0.8 * s.memory  # not compiled: leave a fifth for them
    if usable > 0:
        need = math.ceil(state * s.devices / usable)
        need = max(s.devices + per_host, math.ceil(need / per_host) * per_host)
        out.append(f"{need} devices of this memory ({need // per_host} hosts of {per_host}), the "
                   f"state split over all: {size_text(state * s.devices / need)} of state a device"
                   + (f" beside {size_text(act)} of activations (estimated)" if act is not None
                      else " (the temporaries, not compiled, need room beside it)"))
    else:
        out.append(f"more devices alone do not help: the activations ({size_text(act)} a device) "
                   "exceed the device by themselves")
    if s.param_dtype == "float32":
        peak = state / 2 + (act or 0) / 2
        out.append(_would("--param-dtype bfloat16 (parameters, gradients, optimizer state and "
                          "activations halved)", peak, s.memory, act is None))
    if s.optimizer_name == "adamw":
        opt = s.adafactor_bytes / s.devices
        peak = s.params + opt + s.gradients + (act or 0)
        out.append(_would(f"--optimizer adafactor ({size_text(opt)} of optimizer state a device "
                          f"instead of {size_text(s.optimizer)})", peak, s.memory, act is None))
    if act:
        out.append(_shorter_seq(s, state, act))
    for shards in s.larger_shards:
        peak = state + (act or 0) * s.model_shards / shards
        out.append(_would(f"--model-shards {shards} (activations split over the model shards)",
                          peak, s.memory, act is None))
    if s.remat_pinned_off:
        out.append("--remat, or leave it out so that the plan tries it (each layer recomputed "
                   "in the backward pass: activations of one layer at a time)")
    if s.scan_pinned_off:
        out.append("--scan-layers, or leave --no-scan-layers out (the compiler sees one layer, "
                   "gathered and freed in turn)")
    return out


def _would(change, peak, memory, state_only):
    what = "state" if state_only else "peak"
    verdict = "would fit" if peak <= memory else "would still not fit"
    return f"{change}: {verdict} (estimated {what} {size_text(peak)} a device)"


def _shorter_seq(s, state, act):
    """The longest sequence whose activations leave room for the state, from how they scaled
    between the two compiles (seq and seq/2), else taken as proportional (said so)."""
    if s.half_seq_temporaries is not None and s.half_seq_temporaries > s.gradients:
        half = s.half_seq_temporaries - s.gradients
        k = max(0.5, math.log(act / half) / math.log(s.seq_len / (s.seq_len // 2)))
        how = (f"activations scaled as seq^{k:.2f} between the compiles at {s.seq_len} and "
               f"{s.seq_len // 2}")
    else:
        k, how = 1.0, "activations taken as proportional to the sequence: an estimate"
    room = s.memory - state
    if room <= 0:
        return (f"no shorter --seq-len fits: the state alone ({size_text(state)}) leaves no room "
                "for activations")
    seq = int(s.seq_len * (room / act) ** (1 / k))
    seq = seq // 128 * 128 if seq >= 256 else seq
    if seq < 1:
        return "no --seq-len fits: the state leaves almost no room for activations"
    return f"--seq-len {seq} or shorter would fit ({how})"
