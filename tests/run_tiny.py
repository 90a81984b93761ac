"""A small fit + eval + predict run whose results can be compared across process layouts."""

import jax
import numpy as np
import optax

from redcoast import Trainer
from redcoast.export import flat_tensors
from tiny_lm import collate_fn, loss_fn, make_examples, make_model


def run(deployer):
    """Train 2 epochs (shuffled), evaluate, predict; return host arrays keyed by name."""
    model, params = make_model()
    trainer = Trainer(deployer, collate_fn, model.apply, loss_fn, params,
                      optax.sgd(0.1, momentum=0.9))
    examples = make_examples(48)
    trainer.fit(examples, per_device_batch_size=2, n_epochs=2)
    eval_examples = make_examples(11, seed=5)
    predictor = trainer.get_default_predictor(
        lambda rng, p, batch: model.apply({"params": p}, batch["ids"][:, :-1]).argmax(-1))
    predictions = np.stack(predictor.predict(eval_examples, 1, trainer.params))
    result = {f"param:{k}": v for k, v in flat_tensors(trainer.params).items()}
    result["eval_loss"] = np.array(trainer.eval_loss(eval_examples, 1))
    result["predictions"] = predictions
    result["n_processes"] = np.array(jax.process_count())
    return result
