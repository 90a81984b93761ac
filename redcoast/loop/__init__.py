"""The training loop between ``Trainer.fit`` and the compiled step: one fit's run (checkpoints,
resume, epochs), the between-step actions, evaluation, the step meter, the first state, what
the host may run ahead, preemption and the diagnosis of a NaN batch.

Imports ``layout`` and everything below it; never the Trainer, ``text`` or the command line."""
