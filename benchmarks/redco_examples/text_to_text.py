"""redco's examples/text_to_text/main.py, adapted only to run offline (see README.md):
google/flan-t5-xxl -> the T5 architecture from a tiny config, randomly initialised and saved with
deployer.save_ckpt as its save_init_ckpt.py did; its tokenizer -> a word-level tokenizer built on
the spot; xsum -> synthetic documents whose summary is their first three words; evaluate's rouge
(a hub download) -> a local ROUGE-L F1. transformers 4.57.6's Flax T5 calls
jnp.clip(a_max=...), which jax 0.10 removed: a shim below accepts those keywords again (this
script only). Otherwise redco's code, with its own import."""
import offline  # noqa: F401  (simulated devices, before jax)
from functools import partial
import fire
import numpy as np
import jax.numpy as jnp
import optax
from transformers import T5Config, FlaxAutoModelForSeq2SeqLM

if offline.RUN_ON == "redco":
    from redco import Deployer, Trainer, Predictor
else:
    from redcoast import Deployer, Trainer, Predictor

_jnp_clip = jnp.clip


def _clip_with_old_keywords(a, min=None, max=None, a_min=None, a_max=None, **kwargs):
    # offline shim (not redco's code): jax 0.10 removed clip's a_min/a_max keywords
    return _jnp_clip(a, a_min if min is None else min, a_max if max is None else max, **kwargs)


jnp.clip = _clip_with_old_keywords


def load_dataset(n_train=512, n_validation=64, seed=0):
    # offline: documents of 6-12 words; the summary is the first three
    rng = np.random.default_rng(seed)

    def example():
        words = list(rng.choice(offline.WORDS, rng.integers(6, 13)))
        return {'src': ' '.join(words), 'tgt': ' '.join(words[:3])}

    return {'train': [example() for _ in range(n_train)],
            'validation': [example() for _ in range(n_validation)]}


def rouge_l(prediction, reference):
    # offline: ROUGE-L F1 on words (evaluate.load('rouge') downloads its script)
    p, r = prediction.split(), reference.split()
    lcs = [[0] * (len(r) + 1) for _ in range(len(p) + 1)]
    for i in range(len(p)):
        for j in range(len(r)):
            lcs[i + 1][j + 1] = lcs[i][j] + 1 if p[i] == r[j] else max(lcs[i][j + 1], lcs[i + 1][j])
    n = lcs[-1][-1]
    return 0.0 if n == 0 else 2 * n / (len(p) + len(r))


def collate_fn(examples,
               tokenizer,
               decoder_start_token_id,
               max_src_len,
               max_tgt_len,
               src_key='src',
               tgt_key='tgt'):
    model_inputs = tokenizer(
        [example[src_key] for example in examples],
        max_length=max_src_len,
        padding='max_length',
        truncation=True,
        return_tensors='np')

    decoder_inputs = tokenizer(
        [example[tgt_key] for example in examples],
        max_length=max_tgt_len,
        padding='max_length',
        truncation=True,
        return_tensors='np')

    labels = decoder_inputs['input_ids']
    decoder_inputs['input_ids'] = np.zeros_like(labels)
    decoder_inputs['input_ids'][:, 0] = decoder_start_token_id
    decoder_inputs['input_ids'][:, 1:] = labels[:, :-1]

    model_inputs['labels'] = labels
    for key in decoder_inputs:
        model_inputs[f'decoder_{key}'] = np.array(decoder_inputs[key])

    return model_inputs


def loss_fn(rng, state, params, batch, is_training):
    labels = batch.pop('labels')
    label_weights = batch['decoder_attention_mask']
    logits = state.apply_fn(
        **batch, params=params, dropout_rng=rng, train=is_training)[0]
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=labels)
    return jnp.sum(loss * label_weights) / jnp.sum(label_weights)


def pred_fn(rng, params, batch, model):
    return model.generate(
        input_ids=batch['input_ids'],
        attention_mask=batch['attention_mask'],
        params=params,
        prng_key=rng).sequences


def output_fn(batch_preds, tokenizer):
    return tokenizer.batch_decode(batch_preds, skip_special_tokens=True)


def eval_rouge(examples, preds, tgt_key):
    scores = [rouge_l(pred, example[tgt_key]) for pred, example in zip(preds, examples)]
    return {'rougeL': float(np.mean(scores))}


def main(src_key='src',
         tgt_key='tgt',
         init_ckpt_dir='./workdir_t2t/init',
         n_model_shards=2,
         max_src_len=16,
         max_tgt_len=6,
         num_beams=2,
         n_epochs=3,
         global_batch_size=16,
         per_device_batch_size=4,
         learning_rate=3e-3,
         lr_schedule_type='linear',
         warmup_ratio=0.1,
         grad_norm_clip=1.,
         weight_decay=0.01,
         workdir='./workdir_t2t',
         jax_seed=42):
    deployer = Deployer(
        workdir=workdir,
        jax_seed=jax_seed,
        n_model_shards=n_model_shards)

    dataset = load_dataset()

    tokenizer = offline.word_tokenizer(roberta_style=False)
    compute_dtype = jnp.float32   # offline: CPU (redco's example: bfloat16)
    config = T5Config(vocab_size=len(tokenizer), d_model=64, d_kv=16, d_ff=128, num_layers=2,
                      num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    # offline: save_init_ckpt.py, with random weights instead of the hub's
    deployer.save_ckpt(ckpt_dir=init_ckpt_dir,
                       params=FlaxAutoModelForSeq2SeqLM.from_config(config, seed=0).params)
    model = FlaxAutoModelForSeq2SeqLM.from_config(
        config, dtype=compute_dtype, _do_init=False)
    model.generation_config.update(
        decoder_start_token_id=model.config.decoder_start_token_id,
        max_length=max_tgt_len,
        pad_token_id=tokenizer.pad_token_id,
        num_beams=num_beams)

    accumulate_grad_batches = deployer.get_accumulate_grad_batches(
        global_batch_size=global_batch_size,
        per_device_batch_size=per_device_batch_size)
    deployer.log_info(accumulate_grad_batches, title='accumulate_grad_batches')
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
        'tokenizer': tokenizer,
        'decoder_start_token_id': model.config.decoder_start_token_id,
        'max_src_len': max_src_len,
        'max_tgt_len': max_tgt_len,
        'src_key': src_key,
        'tgt_key': tgt_key,
    }
    trainer = Trainer(
        deployer=deployer,
        collate_fn=partial(collate_fn, **collate_fn_kwargs),
        apply_fn=model,
        loss_fn=loss_fn,
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
        pred_fn=partial(pred_fn, model=model),
        output_fn=partial(output_fn, tokenizer=tokenizer),
        params_sharding_rules=params_sharding_rules)

    trainer.fit(
        train_examples=dataset['train'],
        per_device_batch_size=per_device_batch_size,
        n_epochs=n_epochs,
        eval_examples=dataset['validation'],
        eval_predictor=predictor,
        eval_metric_fn=partial(eval_rouge, tgt_key=tgt_key),
        save_last_ckpt=False,
        save_argmax_ckpt_by_metrics=['rougeL'])

    # added for the comparison: final eval loss and ROUGE-L
    offline.report('eval_loss', trainer.eval_loss(
        examples=dataset['validation'], per_device_batch_size=per_device_batch_size))
    preds = predictor.predict(examples=dataset['validation'], params=trainer.state.params,
                              params_replicated=(trainer.mesh is None),
                              params_sharded=(trainer.mesh is not None),
                              per_device_batch_size=per_device_batch_size)
    offline.report('rougeL', eval_rouge(dataset['validation'], preds, tgt_key)['rougeL'])


if __name__ == '__main__':
    fire.Fire(main)
