"""The heartbeat: a file a process touches to tell ``redcoast launch``'s watchdog it makes progress.

The launcher names the file in each process's environment and reads its time; redcoast's training,
evaluation and prediction loops touch it every batch, so a loop that prints nothing is not taken
for a hang.
"""

import os

ENV_HEARTBEAT_FILE = "REDCOAST_HEARTBEAT_FILE"


def heartbeat():
    """Tell ``redcoast launch`` this process is making progress (for loops that print nothing);
    does nothing outside a launch."""
    path = os.environ.get(ENV_HEARTBEAT_FILE)
    if path:
        with open(path, "a"):
            os.utime(path)
