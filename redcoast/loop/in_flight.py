"""How far the host may run ahead of the devices when several processes run together.

JAX dispatches programs asynchronously: a loop that reads no result queues program after
program. With several processes on CPUs (gloo, jax 0.10 and 0.11), two processes with a few
dozen steps in flight, their collectives across the processes, deadlocked, both waiting in
dispatch for ever (2 processes x 4 CPU devices): training that read its metrics every 64 or 200
updates hung in 5 of 5 runs (every 10, 20 or 30: none of 5); evaluations of 40 batches read at
the end hung in 3 of 3, and still in 2 of 2 with up to 8 batches in flight. With at most one
step left running while the next is dispatched, none of 12 runs hung. On jax 0.11.2 the same:
the 200-update training and the evaluations hung without the wait (1 of 1 each), ran with it;
jax 0.12.0.1 ran them without waiting (1 and 2 runs). So with several CPU processes redcoast's
training and evaluation loops wait for the step before the one just dispatched: the devices
still always have the next step queued. With one process they never wait; nor on GPUs and TPUs,
where no such hang was measured (none lent here) and the wait would be a host sync per step.
"""

import jax


class InFlight:
    """The output of the last step a loop dispatched; with several CPU processes, :meth:`add`
    waits for it once the next one is dispatched."""

    def __init__(self):
        self._waits = jax.process_count() > 1 and jax.default_backend() == "cpu"
        self._previous = None

    def add(self, outputs) -> None:
        """``outputs``: those of the step just dispatched (arrays it computes, not donated)."""
        if not self._waits:
            return
        if self._previous is not None:
            jax.block_until_ready(self._previous)
        self._previous = outputs
