"""How a model is laid out on the devices: the layout (mesh, plan, shardings, jitted steps), its
choice among candidates by cost, the check against one device, the memory and FLOPs of a compiled
step, FSDP's cost, and the layouts remembered between runs.

Imports ``sharding``, ``multihost``, ``store`` and the public modules below the loop (``data``,
``train_state``, ``errors``); never ``loop``, the Trainer or the command line."""
