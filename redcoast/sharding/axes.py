"""The names of redcoast's mesh axes, defined once: every mesh is ``(DATA_AXIS, MODEL_AXIS)``.

Data shards (data parallelism, and FSDP's split of parameters) run along ``DATA_AXIS``; the
model shards (tensor parallelism) along ``MODEL_AXIS``. The short names are what a user writes in
``params_sharding_rules`` and what shardings print.
"""

DATA_AXIS = "dp"
MODEL_AXIS = "mp"
MESH_AXES = (DATA_AXIS, MODEL_AXIS)
