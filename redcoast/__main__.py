"""``python -m redcoast launch -n N script.py``: the ``redcoast`` command without the console script."""

import sys

from .cli.main import cli

sys.exit(cli())
