"""Every test runs on 8 simulated CPU devices; XLA reads the flags when JAX's backend starts."""

import os

from redcoast.simulate import simulate_cpu_devices

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# redcoast's per-user cache (compiled programs, chosen layouts: redcoast/store/user_cache.py) stays
# out of ~/.cache in tests; tests/test_user_cache.py turns it on where it is the subject
os.environ.setdefault("REDCOAST_CACHE", "off")
simulate_cpu_devices(8)


def _another_backends_compiler_installed():
    """Whether libtpu or one of JAX's CUDA plugins (``redcoast plan``'s compilers) is installed."""
    import importlib.metadata

    from redcoast.cli.gpu_targets import CUDA_PLUGINS
    for package in ("libtpu", *CUDA_PLUGINS):
        try:
            importlib.metadata.version(package)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


# The tests' programs are small: XLA's CPU backend spends their time compiling, most of it in
# LLVM's optimizer. Without it the default suite took 615 s summed (5:29 on two workers)
# against 874 s (7:42), all 915 passing, measured one after the other (2026-12-01, jax 0.10.2).
# What the tests check is above LLVM: the HLO, its sharding and collectives, the compiler's
# memory analysis, numbers compared between two programs compiled alike. The examples run with
# XLA's defaults, as a user's script does (tests/example_runner.py drops XLA_FLAGS); so do
# the plan tests that compile for a TPU or GPU target (CI installs those compilers), where the
# flag would reach that backend too.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"] \
        and not _another_backends_compiler_installed():
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"


# The default suite runs twice in CI (Python 3.11 and 3.12) and must stay under 15 minutes on
# 2 cores; these run once, in CI's third step (jax 0.11, `-m run_once`: about 12 minutes on two
# workers), and with the slow tests (`-m slow`). Each keeps a representative in the default
# suite where one is named (test function -> the parameter ids that stay), or none.
# Figures: seconds each took in the default suite (2026-11-25, 2 cores).
import pytest  # noqa: E402

RUN_ONCE = {
    "test_dataflow.py::test_sharded_step_equals_single_device_step":    # 102 s in all
        {"gpt2-4", "gqa-4", "moe-4", "encoder_decoder-2", "bert-2"},
    "test_trainer.py::test_sharded_training_equals_single_device": {"2-2", "8-1"},  # 88 s
    "test_trainer_comms.py::test_moe_remat_and_replicated_kv_stay_within_megatron_traffic":
        {"moe-experts-split"},                                          # 62 s
    "test_trainer_comms.py::test_separate_q_k_v_and_gate_up_reach_megatron_traffic_through_the_trainer":
        {"plain_jax"},                                                  # 51 s
    "test_trainer.py::test_eval_loss_is_the_exact_mean_over_examples": {"13"},  # 42 s
    "test_flops.py::test_a_llama_training_step_is_palms_formula_exactly_on_any_layout":
        {"1-1-2"},                                                      # 29 s
    "test_models_training.py::test_two_model_shards_train_like_one":    # 35 s
        {"llama_gqa", "gpt2", "bert", "bart", "opt", "gptj"},
    "test_trainer.py::test_same_seed_same_run_and_epochs_are_shuffled_differently": set(),  # 46
    "test_stationary_weights.py::"
    "test_the_weights_heavier_than_the_rows_they_read_are_left_and_the_step_trains_the_same": set(),
    "test_throughput.py::test_fit_logs_throughput_mfu_and_the_gradient_norm": set(),  # 45
    "test_abstract.py::test_abstract_trainer_compiles_as_a_real_one_then_trains_like_it": set(),
    "test_abstract.py::test_a_deployer_on_some_of_the_devices_trains_on_those_alone": set(),
    "test_models_gguf.py::test_answers_the_capital_of_france_and_stops_at_eos_as_transformers":
        set(),                                                          # 29 (before transformers')
    "test_models_gguf.py::test_logits_split_over_two_devices_equal_one_device": set(),  # 25
    "test_models_gguf.py::test_logits_match_transformers_on_the_same_weights": set(),  # 12
    # gguf.GGUFReader's own parse of the file is the time; a file of every value type stays
    "test_models_gguf.py::test_the_packaged_files_header_reads_as_gguf_reads_it": set(),  # 8
    "test_auto_shards.py::test_auto_with_a_budget_nothing_meets_says_what_to_change": set(),
    "test_trainer.py::test_dropout_randomness_does_not_depend_on_the_sharding": set(),  # 26
    "test_trainer.py::test_accumulating_k_micro_batches_equals_one_k_times_bigger_batch": set(),
    "test_trainer.py::test_metrics_and_logs_are_written": set(),        # 17
    "test_trainer.py::test_huggingface_dataset_as_examples": set(),     # 17
    "test_dataflow.py::test_fused_siblings_compute_the_same_loss_and_gradients": set(),  # 24
    "test_dataflow.py::test_key_blocks_picked_per_head_keep_the_heads_split": set(),  # 16
    "test_dataflow.py::test_a_weight_is_recognised_by_its_parameter_on_its_way_to_the_matmul":
        set(),                                                          # 11
    "test_dataflow.py::test_per_layer_traffic_is_megatron_with_fused_siblings": set(),  # 10
    "test_checkpoint.py::test_checkpoint_of_another_model_names_the_differences": set(),  # 23
    "test_checkpoint.py::test_damaged_checkpoint_is_skipped_with_a_warning": set(),  # 17
    "test_checkpoint.py::test_kv_heads_kept_by_groups_of_shards_save_and_restore_onto_other_meshes":
        set(),                                                          # 17
    "test_checkpoint.py::test_nan_checkpoints_are_never_written": set(),  # 14
    "test_layout_check.py::test_model_families_in_their_layout_equal_one_device": set(),  # 19
    "test_layout_check.py::test_fit_checks_the_layout_before_the_first_update": set(),  # 9
    "test_scan_layers.py::test_a_scanned_llama_trains_on_2x4_like_the_unrolled_one": set(),  # 36
    "test_plan.py::test_a_plan_with_layers_scanned_holds_the_same_state": set(),  # 26
    "test_scan_layers.py::test_a_scanned_t5_computes_what_the_unrolled_one_does": set(),  # 45
    "test_scan_layers.py::test_a_scanned_model_computes_what_the_unrolled_one_does":  # 36
        {"llama-False"},
    "test_scan_layers.py::test_fsdp_gathers_a_stacked_weight_one_layer_at_a_time": set(),  # 37
    # on jax 0.11, where left to the partitioner the scanned step aborted the process
    "test_scan_layers.py::test_inside_the_scan_the_step_moves_the_unrolled_steps_bytes_over_each_axis":
        set(),                                                          # 18
    "test_grouped_conv.py::test_a_speech_encoder_with_a_grouped_positional_conv_trains_as_on_one_device":
        set(),                                                          # 13
    "test_grouped_conv.py::test_trainer_steps_on_grouped_convolutions_equal_one_device": set(),
    "test_models_t5.py::test_generation_matches_transformers": set(),   # 13
    "test_generate.py::test_greedy_cached_equals_recomputation": set(),  # 12
    "test_generate.py::test_beam_search_equals_transformers": set(),    # 10
    "test_megatron_bytes.py::test_the_projects_families_move_megatrons_bytes_and_say_nothing":
        {"llama"},                                                      # 12 s (2026-11-29)
    "test_megatron_bytes.py::test_the_trainer_measures_its_step_against_megatron_and_stays_quiet_on_its_families":
        {"dense"},                                                      # 10 s
    "test_generate.py::test_beam_sampling": set(),                      # 9
    "test_opt_state.py::test_optimizer_state_is_sharded_and_training_matches_one_device": set(),
    "test_lora.py::test_sharded_lora_training_equals_single_device": set(),  # 9
    # the Sampler's greedy, deleted-parameter and mistake tests stay
    "test_sampling.py::test_samples_are_generates_with_the_key_the_predictor_folds": set(),  # 5
    "test_sampling.py::test_lora_adapters_are_merged_with_the_base_in_the_step": set(),  # 7
    "test_sampling.py::test_logprobs_are_the_sampling_distributions_on_one_device": set(),  # 7
    # the -100 labels, out-of-vocabulary and evaluation diagnoses stay
    "test_errors.py::test_a_nan_loss_before_any_update_from_the_loss_or_the_parameters_says_which":
        set(),                                                          # 8
    "test_attention.py::test_causal_flag_equals_the_explicit_mask": set(),  # 10
    "test_attention.py::test_llama_without_a_mask_equals_an_all_ones_mask": set(),  # 9
    "test_models_bert.py::test_remat_gives_the_same_output": set(),     # 10
    "test_pretrained_heads.py::test_base_folder_loads_as_classifier_with_fresh_logged_head": set(),
    "test_predictor.py::test_laid_out_params_are_used_where_they_are_on_their_own_mesh": set(),
    "test_models_training.py::test_more_model_shards_than_kv_heads_split_the_query_heads": set(),
    "test_trainer_comms.py::test_left_to_choose_fusion_is_decided_by_the_compiled_steps_estimates":
        set(),                                                          # 10
    "test_permuted.py::test_the_trainer_splits_gpt2s_fused_c_attn_by_heads_at_megatron_traffic":
        set(),                                                          # 9
    "test_plan.py::test_a_plan_that_does_not_fit_says_what_would": set(),  # 9
    "test_packing.py::test_packed_rows_train_in_the_sharded_layout_as_on_one_device": set(),  # 16
    # JAX's cache-hit events and config names, on the GPU machines' jax: three processes, 12 s
    "test_user_cache.py::test_a_second_run_compiles_from_the_cache_and_computes_the_same": set(),
    "test_packing.py::test_the_packed_loss_and_gradient_equal_the_padded_ones": set(),  # 5
    "test_train_cli.py::test_a_run_from_a_file_keeps_its_record_and_reruns_from_it": set(),  # 18
    # a scanned family against its unrolled self: GPT-2 with remat stays (2026-11-29: 96 s
    # moved; BART 27 and 20, BERT 13, its classifier 13, GPT-2 11, ViT 11; 2026-11-30: GPT-J
    # plain, 17 s: the scan's jax-dependent part is every family's, GPT-2's covers it)
    "test_scan_families.py::test_a_scanned_family_computes_what_the_unrolled_one_does":
        {"gpt2-True"},
    # 2026-11-30, for CI's 45 minutes: packing's masks and positions, and beam search inside a
    # Predictor, depend on no jax line of their own (14 and 11 s)
    "test_train_cli.py::test_packed_rows_give_the_loss_of_the_same_examples_padded": set(),
    "test_generate.py::test_beam_search_inside_a_predictor": set(),
    "test_scan_families.py::test_scanned_decoders_generate_what_the_unrolled_ones_do": {"gpt2"},
    "test_scan_families.py::test_a_scanned_gpt2_attends_to_an_encoder_like_the_unrolled_one":
        set(),                                                          # 14
    # the precision note on a real model (5 s); its rule is checked on every line in the same file
    "test_precision_note.py::test_a_llama_left_at_float32_is_told_and_one_at_bfloat16_is_not":
        set(),
    "test_train_cli.py::test_bf16_compute_runs_the_model_in_bf16_not_float32_with_rounded_weights":
        set(),                                                          # 6
    # a bf16 Llama compiled with and without the CPU options (5 s on jax 0.12; jax 0.11 keeps
    # bf16 products as 0.12 does, so step 3 exercises the whole test; jax 0.10 returns at once)
    "test_compiler_options.py::test_a_16_bit_step_on_xla_cpu_multiplies_in_ynnpack_and_computes_the_same_loss":
        set(),
}


# Those of RUN_ONCE that compare with the PyTorch reference: CI's third step has no PyTorch
# (on Python 3.12 pip gets its CUDA wheels, 3.4 GB), so these run in the slow step instead, on the
# machine's Python, which has it. A run-once test that skips in the third step would run nowhere:
# .ci/run fails that step unless every run-once test collected where PyTorch is passes there.
NEEDS_THE_REFERENCE = {
    "test_models_gguf.py::test_answers_the_capital_of_france_and_stops_at_eos_as_transformers",
    "test_models_gguf.py::test_logits_match_transformers_on_the_same_weights",
    "test_models_t5.py::test_generation_matches_transformers",
    "test_generate.py::test_beam_search_equals_transformers",
    "test_models_bert.py::test_remat_gives_the_same_output",  # its file compares with transformers
}


def pytest_configure(config):
    import heavy_first  # beside this file: the heaviest test files first (CI's two workers)
    config.pluginmanager.register(heavy_first, "heavy_first")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.nodeid.split("/")[-1].split("[")[0]
        if name in RUN_ONCE:
            param = item.callspec.id if hasattr(item, "callspec") else None
            if param not in RUN_ONCE[name]:
                item.add_marker(pytest.mark.slow)
                if name not in NEEDS_THE_REFERENCE:
                    item.add_marker(pytest.mark.run_once)
