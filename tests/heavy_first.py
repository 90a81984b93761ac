"""Test files with the heaviest tests run first, so that a step of few long tests ends on both
workers together.

pytest-xdist's ``worksteal`` gives each worker a contiguous half of the collection and lets an
idle worker take the back half of the other's queue; a 70-second test collected last then runs
alone at the end while the other worker waits. Ordering the files by their heaviest test,
longest first, leaves the short ones for the end, where stealing evens the workers out. Whole
files move, each keeping its own order: a file's module-scoped fixtures are set up once, as
before. Measured (2026-11-30, an empty compilation cache each): CI's examples step, 17 tests,
ran 56 s longer than half its tests' summed time before and 14 s after; the slow step (150
tests) and the run-once tests (117), compute-bound rather than tail-bound, did not change
(7:16 against 7:08 for the run-once ones). The slow tests and the examples now run as one
step (.ci/run): 170 tests in 19:25, against 15:15 and 5:33 as two steps.
"""

import pytest

# The longest test of each file on this 2-core machine under CI's two workers, in seconds
# (2026-11-30, every CI step's tests: --durations=0). Files not named here (all under 10 s)
# keep their place after these. Refresh from a run's --durations when a file's heaviest test
# changes by much; a stale figure costs only time.
HEAVIEST = {
    "test_examples_vision.py": 73,
    "test_benchmarks.py": 73,
    "test_multiprocess.py": 71,
    "test_examples_nlp.py": 61,
    "test_examples_lora.py": 56,
    "test_train_cli.py": 50,
    "test_examples_rl.py": 47,
    "test_zoo_by_others.py": 45,
    "test_examples_train_yaml.py": 41,
    "test_conv_tp.py": 34,
    "test_scan_families.py": 28,
    "test_auto_shards.py": 23,
    "test_written_by_others.py": 22,
    "test_trainer_comms.py": 22,
    "test_layout_check.py": 20,
    "test_scan_layers.py": 20,
    "test_plan.py": 20,
    "test_models_gguf.py": 20,
    "test_launch.py": 19,
    "test_checkpoint.py": 18,
    "test_batch_split.py": 17,
    "test_faults.py": 17,
    "test_fsdp.py": 16,
    "test_stationary_weights.py": 14,
    "test_models_training.py": 13,
    "test_generate_options.py": 13,
    "test_megatron_bytes.py": 13,
    "test_quiet_acceptances.py": 12,
    "test_run_record.py": 12,
    "test_trainer.py": 11,
    "test_throughput.py": 11,
    "test_models_bert.py": 10,
}


def file_of(item):
    return item.nodeid.split("::")[0].rsplit("/", 1)[-1]


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    first = {}
    for i, item in enumerate(items):
        first.setdefault(file_of(item), i)
    # a stable sort: within a file, and among the files not named, the collection's order
    items.sort(key=lambda item: (-HEAVIEST.get(file_of(item), 0), first[file_of(item)]))
