"""The ``redcoast`` console command: ``redcoast launch``, ``redcoast plan``, ``redcoast train``.

Each command's module is imported when that command runs.
"""

import sys


def cli(argv=None):
    """Entry point of the ``redcoast`` console script: ``redcoast launch ...``, ``redcoast plan
    ...``, ``redcoast train ...``, ``redcoast --version``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: redcoast launch -n N [--local-devices K] script.py [args ...]\n"
              "       redcoast plan CONFIG --devices N --device-memory SIZE --seq-len L\n"
              "       redcoast train run.yaml [--section.field=value ...]\n\n"
              "Commands:\n  launch   start N processes of one run on this machine "
              "(redcoast launch --help)\n  plan     the layout and memory per device of a "
              "training run on hardware you do not have (redcoast plan --help)\n  train    "
              "fine-tune a model as a YAML file says (redcoast train --help)",
              file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        from .. import __version__
        print(f"redcoast {__version__}")
        return 0
    if argv[0] == "plan":
        from .plan_command import main as plan_main
        return plan_main(argv[1:])
    if argv[0] == "train":
        from .train_command import main as train_main
        return train_main(argv[1:])
    if argv[0] != "launch":
        print(f"redcoast: unknown command {argv[0]!r}. Fix: use `redcoast launch -n N script.py`, "
              "`redcoast plan CONFIG ...` or `redcoast train run.yaml`.", file=sys.stderr)
        return 2
    from .launch_command import main as launch_main
    return launch_main(argv[1:])
