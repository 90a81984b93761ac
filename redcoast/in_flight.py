"""How far the host may run ahead of the devices when several processes run together.

JAX dispatches programs asynchronously: a loop that reads no result queues program after
program. With several processes on CPUs (gloo, jax 0.10 and 0.11), two processes with a few
dozen steps in flight, their collectives across the processes, deadlocked, both waiting in
dispatch for ever (2 processes x 4 CPU devices): training that read its metrics every 64 or 200
updates hung in 5 of 5 runs (every 10, 20 or 30: none of 5); evaluations of 40 batches read at
the end hung in 3 of 3, and still in 2 of 2 with up to 8 batches in flight. With at most one
step left running while the next is dispatched, none of 12 runs hung. On jax 0.11.2 the same:
the 200-update training and the evaluations hung without the wait (1 of 1 each), ran with it;
jax 0.12.0.1 ran them without waiting (1 and 2 runs); GPUs were not measured. So redcoast's
training and evaluation loops wait, with several processes, for the step before the one just
dispatched: the devices still always have the next step queued. With one process they never
wait.
"""

import collections

import jax

LIMIT = 1  # steps left running when the next one is dispatched


class InFlight:
    """The outputs of the steps a loop dispatched and has not read; with several processes,
    :meth:`add` waits for the oldest once more than ``limit`` are in flight."""

    def __init__(self, limit: int = LIMIT):
        self.limit = limit
        self._outputs: collections.deque = collections.deque()

    def add(self, outputs) -> None:
        if jax.process_count() == 1:
            return
        self._outputs.append(outputs)
        while len(self._outputs) > self.limit:
            jax.block_until_ready(self._outputs.popleft())
