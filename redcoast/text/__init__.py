"""Text data for language models: packing, chat conversations through a template, log-probabilities
of completions, and completions sampled from a Trainer's parameters.

Imports the public modules, ``models`` and below; never the command line."""
