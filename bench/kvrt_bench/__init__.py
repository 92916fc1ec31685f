"""Headline benchmark harnesses behind ``kvrt bench NAME``, one module each.

Each module defines ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``,
prints progress while it runs and writes JSON/CSV/PNG results under ``--out``.
"""
