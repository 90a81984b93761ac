"""Argument types shared by redcoast's commands (``redcoast launch``, ``redcoast plan``).

Each is an argparse ``type``: a bad value becomes argparse's usage error naming the flag
(``argument --hosts: 0 is not a positive integer ...``), before any work starts.
"""

import argparse
import math


def positive_int(text):
    """A count: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer: a count must be "
                                         "a whole number, at least 1")
    return value


def seconds(text):
    """A duration: a number of seconds, 0 or more (inf: never)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return value
