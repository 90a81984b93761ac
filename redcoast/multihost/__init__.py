"""Processes and hosts: starting ``jax.distributed``, what one process holds of a global array,
placing trees the same way on every process, and ``redcoast launch``'s launcher and heartbeat.

Imports only ``errors`` and ``simulate``."""
