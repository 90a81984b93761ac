"""redco's examples/classification_regression/main.py, adapted only to run offline (see
README.md): FacebookAI/roberta-large -> the RoBERTa architecture from a tiny config, randomly
initialised and saved with deployer.save_ckpt as its save_init_ckpt.py did; its tokenizer -> a
word-level tokenizer built on the spot; GLUE sst2 -> synthetic sentences whose label says
whether positive words outnumber negative ones. Otherwise redco's code, with its own import."""
import offline  # noqa: F401  (simulated devices, before jax)
from functools import partial
import fire
import jax.numpy as jnp
import numpy as np
import optax
from transformers import RobertaConfig, FlaxAutoModelForSequenceClassification

if offline.RUN_ON == "redco":
    from redco import Deployer, Trainer, Predictor
else:
    from redcoast import Deployer, Trainer, Predictor


def load_dataset(n_train=512, n_validation=128, seed=0):
    # offline: sst2-like sentences; label 1 when positive words outnumber negative ones
    rng = np.random.default_rng(seed)
    positive, negative = ["good", "great", "fun"], ["bad", "awful", "dull"]
    filler = [w for w in offline.WORDS if w not in positive + negative]

    def sentence():
        n_pos, n_neg = rng.integers(0, 4), rng.integers(0, 4)
        while n_pos == n_neg:
            n_pos, n_neg = rng.integers(0, 4), rng.integers(0, 4)
        words = list(rng.choice(positive, n_pos)) + list(rng.choice(negative, n_neg)) + \
            list(rng.choice(filler, rng.integers(2, 8)))
        rng.shuffle(words)
        return {'sentence': ' '.join(words), 'label': int(n_pos > n_neg)}

    return {'train': [sentence() for _ in range(n_train)],
            'validation': [sentence() for _ in range(n_validation)]}


def collate_fn(
        examples, sent0_key, sent1_key, label_key, tokenizer, max_length):
    texts = []
    for example in examples:
        if sent1_key is None:
            texts.append(example[sent0_key])
        else:
            texts.append((example[sent0_key], example[sent1_key]))

    batch = tokenizer(
        texts,
        max_length=max_length,
        padding='max_length',
        truncation=True,
        return_tensors='np')
    batch['labels'] = np.array([example[label_key] for example in examples])

    return batch


def loss_fn(rng, state, params, batch, is_training, is_regression):
    labels = batch.pop('labels')
    logits = state.apply_fn(
        **batch, params=params, dropout_rng=rng, train=is_training).logits

    if is_regression:
        return jnp.mean(jnp.square(logits[..., 0] - labels))
    else:
        return optax.softmax_cross_entropy_with_integer_labels(
            logits=logits, labels=labels).mean()


def pred_fn(rng, params, batch, model, is_regression):
    batch.pop('labels')
    logits = model(**batch, params=params, train=False).logits

    if is_regression:
        return logits[..., 0]
    else:
        return logits.argmax(axis=-1)


def eval_metric_fn(examples, preds, label_key, is_regression):
    preds = np.array(preds)
    labels = np.array([example[label_key] for example in examples])

    if is_regression:
        return {'square error': np.mean(np.square(preds - labels))}
    else:
        return {'acc': np.mean(preds == labels).item()}


def main(sent0_key='sentence',
         sent1_key=None,
         label_key='label',
         is_regression=False,
         init_ckpt_dir='./workdir_cls/init',
         max_length=16,
         n_model_shards=1,
         global_batch_size=32,
         per_device_batch_size=2,
         n_epochs=3,
         learning_rate=1e-3,
         warmup_ratio=0.1,
         lr_schedule_type='linear',
         grad_norm_clip=1.,
         weight_decay=0.,
         jax_seed=42,
         workdir='./workdir_cls'):
    deployer = Deployer(
        workdir=workdir,
        jax_seed=jax_seed,
        n_model_shards=n_model_shards)

    dataset = load_dataset()
    num_labels = 1 if is_regression \
        else len(set([example[label_key] for example in dataset['train']]))
    deployer.log_info(num_labels, title='num_labels')

    tokenizer = offline.word_tokenizer()
    compute_dtype = jnp.float32   # offline: CPU (redco's example: bfloat16)
    config = RobertaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=128,
                           max_position_embeddings=max_length + 2, num_labels=num_labels,
                           pad_token_id=1, bos_token_id=0, eos_token_id=2)
    # offline: save_init_ckpt.py, with random weights instead of the hub's
    deployer.save_ckpt(ckpt_dir=init_ckpt_dir, params=FlaxAutoModelForSequenceClassification
                       .from_config(config, seed=0).params)
    model = FlaxAutoModelForSequenceClassification.from_config(
        config, dtype=compute_dtype, _do_init=False)

    accumulate_grad_batches = deployer.get_accumulate_grad_batches(
        global_batch_size=global_batch_size,
        per_device_batch_size=per_device_batch_size)
    lr_schedule_fn = deployer.get_lr_schedule_fn(
        train_size=len(dataset['train']),
        per_device_batch_size=per_device_batch_size,
        n_epochs=n_epochs,
        learning_rate=learning_rate,
        schedule_type=lr_schedule_type,
        warmup_ratio=warmup_ratio)
    optimizer = optax.MultiSteps(optax.chain(
        optax.clip_by_global_norm(grad_norm_clip),
        optax.adamw(learning_rate=lr_schedule_fn, weight_decay=weight_decay)
    ), every_k_schedule=accumulate_grad_batches)

    ckpt, info = deployer.load_last_ckpt(
        optimizer=optimizer, float_dtype=jnp.float32)
    if ckpt is None:
        ckpt, info = deployer.load_ckpt(
            ckpt_dir=init_ckpt_dir, update_rng=False, float_dtype=jnp.float32)

    params_sharding_rules = deployer.get_sharding_rules(
        params_shape_or_params=ckpt['params'])
    if params_sharding_rules is not None:
        deployer.log_info(
            info='\n'.join([str(t) for t in params_sharding_rules]),
            title='Sharding rules')

    collate_fn_kwargs = {
        'sent0_key': sent0_key,
        'sent1_key': sent1_key,
        'label_key': label_key,
        'tokenizer': tokenizer,
        'max_length': max_length,
    }
    trainer = Trainer(
        deployer=deployer,
        collate_fn=partial(collate_fn, **collate_fn_kwargs),
        apply_fn=model,
        loss_fn=partial(loss_fn, is_regression=is_regression),
        params=ckpt.pop('params'),
        opt_state=ckpt.pop('opt_state'),
        last_ckpt_info=info,
        optimizer=optimizer,
        compute_dtype=compute_dtype,
        lr_schedule_fn=lr_schedule_fn,
        accumulate_grad_batches=accumulate_grad_batches,
        params_sharding_rules=params_sharding_rules)

    predictor = Predictor(
        deployer=deployer,
        collate_fn=partial(collate_fn, **collate_fn_kwargs),
        pred_fn=partial(pred_fn, model=model, is_regression=is_regression),
        params_sharding_rules=params_sharding_rules)

    trainer.fit(
        train_examples=dataset['train'],
        eval_examples=dataset['validation'],
        per_device_batch_size=per_device_batch_size,
        n_epochs=n_epochs,
        eval_predictor=predictor,
        eval_metric_fn=partial(
            eval_metric_fn,
            label_key=label_key,
            is_regression=is_regression)
    )

    # added for the comparison: final eval loss and accuracy
    offline.report('eval_loss', trainer.eval_loss(
        examples=dataset['validation'], per_device_batch_size=per_device_batch_size))
    preds = predictor.predict(examples=dataset['validation'], params=trainer.state.params,
                              params_replicated=(trainer.mesh is None),
                              params_sharded=(trainer.mesh is not None),
                              per_device_batch_size=per_device_batch_size)
    offline.report('acc', eval_metric_fn(dataset['validation'], preds, label_key, is_regression)['acc'])


if __name__ == '__main__':
    fire.Fire(main)
