"""The API reference, built from the docstrings with pdoc: ``python docs/api.py [OUT_DIR]``.

Documents the public modules below (each module's ``__all__`` where it has one) as HTML in
OUT_DIR (default ``docs/_build/api``; open its ``index.html``). CI builds it on every run and
fails on any pdoc warning (a docstring reference that does not resolve, a module that does not
import), so the reference cannot fall behind the code. Needs the ``docs`` extra (pdoc).
"""

import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# what a user imports: the package (Deployer, Trainer, Predictor in redco's forms, errors, LoRA,
# ShardingPlan), the core classes they extend, the models and generation, data helpers,
# planning, a run as a file, simulated devices, the per-user cache
PUBLIC = [
    "redcoast", "redcoast.trainer", "redcoast.deployer", "redcoast.predictor", "redcoast.models",
    "redcoast.data", "redcoast.text.packing", "redcoast.text.chat_data", "redcoast.text.logprobs",
    "redcoast.text.sampling", "redcoast.cli.plan_command", "redcoast.cli.run_config",
    "redcoast.simulate", "redcoast.errors", "redcoast.progress", "redcoast.lora",
    "redcoast.export", "redcoast.sharding", "redcoast.store.user_cache", "redcoast.multihost.placement",
]


def build(out_dir):
    """Write the reference into ``out_dir``; raise on any pdoc warning."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))  # this checkout, whatever is installed
    import pdoc

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning is a broken reference: fail, do not skip
        pdoc.pdoc(*PUBLIC, output_directory=Path(out_dir))
    return Path(out_dir) / "index.html"


if __name__ == "__main__":
    index = build(sys.argv[1] if len(sys.argv) > 1 else ROOT / "docs" / "_build" / "api")
    print(f"API reference: {index}")
