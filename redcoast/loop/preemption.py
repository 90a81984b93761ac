"""Stopping cleanly on SIGTERM / SIGINT: finish the step, save, exit; a second signal exits at once."""

import os
import signal
import threading

import numpy as np

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionGuard:
    """While active, the first stop signal only sets ``requested``; the second kills at once.

    Handlers can only be installed from the main thread; elsewhere the guard stays inert.
    """

    def __init__(self):
        self.requested = False
        self.signal_name = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        return False

    def _handle(self, signum, frame):
        if self.requested:  # second signal: the user means it
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        print(f"\n[redcoast] {self.signal_name} received: finishing this step, saving a checkpoint "
              "and exiting (send it again to exit at once).", flush=True)

    def requested_anywhere(self):
        """True if any process was asked to stop (every process must call this together)."""
        import jax
        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils
        flags = multihost_utils.process_allgather(np.int32(self.requested))
        return bool(np.any(flags))
