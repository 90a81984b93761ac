"""redco's examples/lora/ (main.py, lora_utils.py) in one file, adapted only to run offline (see
README.md): facebook/bart-base -> the BART architecture from a tiny config, randomly initialised
and saved with deployer.save_ckpt as its save_init_ckpt.py did; its tokenizer -> a word-level
tokenizer built on the spot; financial_phrasebank -> synthetic sentences labelled
positive/negative/neutral; global_batch_size = per_device_batch_size x 8 devices (its 16 does not
divide into 8 devices' micro-batches). Otherwise redco's code, with its own import (per-subtree
sharding rules, optax.multi_transform labels built with freeze(...), MultiSteps inside it)."""
import offline  # noqa: F401  (simulated devices, before jax)
from functools import partial
import fire
import numpy as np
import jax
import jax.numpy as jnp
from flax.traverse_util import path_aware_map, flatten_dict, unflatten_dict
from flax.core.frozen_dict import freeze
import optax
from transformers import BartConfig, FlaxAutoModelForSeq2SeqLM

if offline.RUN_ON == "redco":
    from redco import Deployer, Trainer, Predictor
else:
    from redcoast import Deployer, Trainer, Predictor

LABELS = ['negative', 'neutral', 'positive']


# ---------------------------------------------------------------- lora_utils.py
def get_lora(model_params, lora_rank, rng):
    initializer = jax.nn.initializers.he_uniform()
    lora_params_flat = {}
    for path, param in flatten_dict(model_params).items():
        if path[-1] == 'kernel' and len(param.shape) == 2:
            lora_params_flat[path[:-1]] = {
                'a': initializer(rng, (param.shape[0], lora_rank), jnp.float32),
                'b': jnp.zeros((lora_rank, param.shape[1]))
            }

    return unflatten_dict(lora_params_flat)


def aggregate_params(model_params, lora_params, lora_alpha):
    model_params_flat = flatten_dict(model_params)
    lora_params_flat = flatten_dict(lora_params)

    params_flat = {}
    for path, param in model_params_flat.items():
        if path[-1] == 'kernel' and len(param.shape) == 2:
            a = lora_params_flat[(*path[:-1], 'a')]
            b = lora_params_flat[(*path[:-1], 'b')]
            params_flat[path] = param + jnp.matmul(a, b) * lora_alpha
        else:
            params_flat[path] = param

    return unflatten_dict(params_flat)


# ---------------------------------------------------------------- main.py
def get_dataset(n_train=512, n_validation=64, seed=0):
    # offline: financial_phrasebank-like sentences; the label is the majority sentiment
    rng = np.random.default_rng(seed)
    positive, negative = ["good", "great", "fun"], ["bad", "awful", "dull"]
    filler = [w for w in offline.WORDS if w not in positive + negative]

    def example():
        n_pos, n_neg = rng.integers(0, 3), rng.integers(0, 3)
        words = list(rng.choice(positive, n_pos)) + list(rng.choice(negative, n_neg)) + \
            list(rng.choice(filler, rng.integers(2, 6)))
        rng.shuffle(words)
        label = 2 if n_pos > n_neg else 0 if n_neg > n_pos else 1
        return {'sentence': ' '.join(words), 'label': label, 'text_label': LABELS[label]}

    dataset = {'train': [example() for _ in range(n_train)],
               'validation': [example() for _ in range(n_validation)]}
    src_key, tgt_key = 'sentence', 'text_label'
    print('DATA EXAMPLE:', dataset['train'][0])

    return dataset, src_key, tgt_key


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


def loss_fn(rng, state, params, batch, is_training, lora_alpha):
    labels = batch.pop('labels')
    label_weights = batch['decoder_attention_mask']

    params = aggregate_params(
        model_params=params['model'],
        lora_params=params['lora'],
        lora_alpha=lora_alpha)

    logits = state.apply_fn(
        **batch, params=params, dropout_rng=rng, train=is_training)[0]
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=labels)
    return jnp.sum(loss * label_weights) / jnp.sum(label_weights)


def pred_fn(rng, params, batch, model, lora_alpha):
    params = aggregate_params(
        model_params=params['model'],
        lora_params=params['lora'],
        lora_alpha=lora_alpha)

    return model.generate(
        input_ids=batch['input_ids'],
        attention_mask=batch['attention_mask'],
        params=params,
        prng_key=rng).sequences


def output_fn(batch_preds, tokenizer):
    return tokenizer.batch_decode(batch_preds, skip_special_tokens=True)


def eval_acc(examples, preds, tgt_key):
    n_correct = sum([
        int(pred == example[tgt_key]) for pred, example in zip(preds, examples)
    ])
    return {'acc': n_correct / len(examples)}


def main(lora_rank=8,
         lora_alpha=32,
         init_ckpt_dir='./workdir_lora/init',
         n_model_shards=1,
         max_src_len=16,
         max_tgt_len=4,
         num_beams=1,
         n_epochs=3,
         global_batch_size=32,
         per_device_batch_size=4,
         learning_rate=1e-3,
         lr_schedule_type='linear',
         warmup_ratio=0.,
         grad_norm_clip=1.,
         weight_decay=0.01,
         workdir='./workdir_lora',
         jax_seed=42):
    deployer = Deployer(
        workdir=workdir,
        jax_seed=jax_seed,
        n_model_shards=n_model_shards)

    dataset, src_key, tgt_key = get_dataset()

    tokenizer = offline.word_tokenizer(words=offline.WORDS + LABELS)
    compute_dtype = jnp.float32   # offline: CPU (redco's example: float16)
    config = BartConfig(vocab_size=len(tokenizer), d_model=64, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=32,
                        pad_token_id=1, bos_token_id=0, eos_token_id=2,
                        decoder_start_token_id=2, forced_eos_token_id=2)
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

    model_init_ckpt, _ = deployer.load_ckpt(
        ckpt_dir=init_ckpt_dir, update_rng=False, float_dtype=jnp.float32)
    lora_params = get_lora(
        model_params=model_init_ckpt['params'],
        lora_rank=lora_rank,
        rng=deployer.gen_rng())
    params = {'model': model_init_ckpt.pop('params'), 'lora': lora_params}

    params_sharding_rules = {
        'model': deployer.get_sharding_rules(params['model']),
        'lora': None
    }
    if n_model_shards > 1:
        deployer.log_info(
            info='\n'.join([str(t) for t in params_sharding_rules['model']]),
            title='Sharding rules')

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
    optimizer = optax.multi_transform(
        transforms={'model': optax.set_to_zero(), 'lora': optimizer},
        param_labels=freeze(path_aware_map(lambda path, _: path[0], params))
    )

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
        loss_fn=partial(loss_fn, lora_alpha=lora_alpha),
        params=params,
        optimizer=optimizer,
        compute_dtype=compute_dtype,
        lr_schedule_fn=lr_schedule_fn,
        accumulate_grad_batches=accumulate_grad_batches,
        params_sharding_rules=params_sharding_rules)

    predictor = Predictor(
        deployer=deployer,
        collate_fn=partial(collate_fn, **collate_fn_kwargs),
        pred_fn=partial(pred_fn, model=model, lora_alpha=lora_alpha),
        output_fn=partial(output_fn, tokenizer=tokenizer),
        params_sharding_rules=params_sharding_rules)

    trainer.fit(
        train_examples=dataset['train'],
        per_device_batch_size=per_device_batch_size,
        n_epochs=n_epochs,
        eval_examples=dataset['validation'],
        eval_predictor=predictor,
        eval_metric_fn=partial(eval_acc, tgt_key=tgt_key))

    deployer.save_ckpt(
        './lora',
        params=trainer.get_params_to_save()['lora'],
        float_dtype=jnp.float32)

    # added for the comparison: final eval loss and accuracy
    offline.report('eval_loss', trainer.eval_loss(
        examples=dataset['validation'], per_device_batch_size=per_device_batch_size))
    preds = predictor.predict(examples=dataset['validation'], params=trainer.state.params,
                              params_replicated=(trainer.mesh is None),
                              params_sharded=(trainer.mesh is not None),
                              per_device_batch_size=per_device_batch_size)
    offline.report('acc', eval_acc(dataset['validation'], preds, tgt_key)['acc'])


if __name__ == '__main__':
    fire.Fire(main)
