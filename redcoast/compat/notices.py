"""How the compatibility layer tells a redco user that redcoast does something differently."""

import warnings


class RedcoCompatWarning(UserWarning):
    """A redco 0.4.23 form was accepted and translated; the message gives the redcoast way."""


def warn_redco(message):
    """Warn (once per message and call site, Python's default) that a redco form was translated."""
    warnings.warn(message, RedcoCompatWarning, stacklevel=3)
