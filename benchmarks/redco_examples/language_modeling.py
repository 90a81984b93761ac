"""redco's examples/language_modeling/main.py, adapted only to run offline (see README.md):
huggyllama/llama-13b -> the same Llama architecture from a tiny config, randomly initialised and
saved with deployer.save_ckpt as its make_init_ckpt.py did; the tokenized wikitext dataset ->
synthetic token streams with a learnable pattern. Otherwise redco's code, with its own import."""
import offline  # noqa: F401  (simulated devices, before jax)
import fire
import numpy as np
import jax
import jax.numpy as jnp
import optax
from transformers import LlamaConfig, FlaxAutoModelForCausalLM

if offline.RUN_ON == "redco":
    from redco import Deployer, Trainer
else:
    from redcoast import Deployer, Trainer


def get_dataset(eos_token_id, context_length, vocab_size=64, n_tokens=20000, seed=0):
    # offline: a token stream whose next token follows from the previous one (+step mod vocab)
    rng = np.random.default_rng(seed)
    tokens, examples, tokens_buffer = [], [], []
    while len(tokens) < n_tokens:
        start, step, length = rng.integers(3, vocab_size), rng.integers(1, 4), rng.integers(8, 40)
        tokens.extend(3 + (start + step * np.arange(length)) % (vocab_size - 3))
        tokens.append(eos_token_id)
    tokens_buffer = [int(t) for t in tokens]
    while len(tokens_buffer) >= context_length:
        examples.append({'token_ids': tokens_buffer[:context_length]})
        tokens_buffer = tokens_buffer[context_length:]

    cut = int(0.9 * len(examples))
    return {'train': examples[:cut], 'validation': examples[cut:]}


def collate_fn(examples):
    token_ids = np.array([examples['token_ids'] for examples in examples])
    return {'input_ids': token_ids[:, :-1], 'labels': token_ids[:, 1:]}


def loss_fn(rng, state, params, batch, is_training):
    labels = batch.pop("labels")
    logits = state.apply_fn(
        **batch, params=params, dropout_rng=rng, train=is_training)[0]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=labels).mean()


def main(init_ckpt_dir='./workdir_lm/init',
         context_length=33,
         n_model_shards=2,
         n_epochs=2,
         global_batch_size=16,
         per_device_batch_size=2,
         learning_rate=3e-3,
         lr_schedule_type='linear',
         warmup_ratio=0.1,
         grad_norm_clip=1.,
         weight_decay=0.01,
         workdir='./workdir_lm',
         jax_seed=42):
    deployer = Deployer(
        workdir=workdir,
        jax_seed=jax_seed,
        n_model_shards=n_model_shards)

    compute_dtype = jnp.float32   # offline: CPU (redco's example: bfloat16)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=64, eos_token_id=2)
    # offline: make_init_ckpt.py, with random weights instead of the hub's
    init_model = FlaxAutoModelForCausalLM.from_config(config, seed=0)
    deployer.save_ckpt(ckpt_dir=init_ckpt_dir, params=init_model.params)

    model = FlaxAutoModelForCausalLM.from_config(
        config, dtype=compute_dtype, _do_init=False)
    dataset = get_dataset(
        eos_token_id=model.config.eos_token_id,
        context_length=context_length)

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

    trainer = Trainer(
        deployer=deployer,
        collate_fn=collate_fn,
        apply_fn=model,
        loss_fn=loss_fn,
        params=ckpt.pop('params'),
        opt_state=ckpt.pop('opt_state'),
        params_sharded=True,
        opt_state_sharded=True,
        last_ckpt_info=info,
        optimizer=optimizer,
        compute_dtype=compute_dtype,
        lr_schedule_fn=lr_schedule_fn,
        accumulate_grad_batches=accumulate_grad_batches,
        params_sharding_rules=params_sharding_rules)

    trainer.fit(
        train_examples=dataset['train'],
        eval_examples=dataset['validation'],
        n_epochs=n_epochs,
        per_device_batch_size=per_device_batch_size,
        save_last_ckpt=False,
        save_opt_states=False)

    # added for the comparison: the final eval loss on whole batches (redco drops a partial one)
    n_eval = len(dataset['validation']) // 16 * 16
    offline.report('eval_loss', trainer.eval_loss(
        examples=dataset['validation'][:n_eval], per_device_batch_size=per_device_batch_size))


if __name__ == '__main__':
    fire.Fire(main)
