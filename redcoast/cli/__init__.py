"""The ``redcoast`` command: its dispatcher, ``launch``, ``plan`` (a run's layout and memory on
hardware that is not here) and ``train`` (a run as a YAML file), with what each reads.

The top wing: it may import anything in redcoast; nothing imports it."""
