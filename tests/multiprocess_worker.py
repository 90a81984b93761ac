"""One process of a multi-process run on loopback, started by test_multiprocess.py.

    python multiprocess_worker.py PROCESS_ID N_PROCESSES PORT N_LOCAL_DEVICES N_MODEL_SHARDS OUT_DIR
"""

import os
import sys

import numpy as np


def main():
    process_id, n_processes, port, n_local, n_model_shards = map(int, sys.argv[1:6])
    out_dir = sys.argv[6]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from redcoast import Deployer
    from run_tiny import run

    deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, verbose=False,
                        n_processes=n_processes, host0_address="127.0.0.1", host0_port=port,
                        process_id=process_id, n_local_devices=n_local)
    result = run(deployer)
    np.savez(os.path.join(out_dir, f"process_{process_id}.npz"), **result)


if __name__ == "__main__":
    main()
