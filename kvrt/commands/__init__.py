"""Subcommands of the ``kvrt`` CLI, one module each (see :mod:`kvrt.cli`)."""
