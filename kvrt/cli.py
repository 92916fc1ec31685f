"""The ``kvrt`` command.

Each subcommand is a module of :mod:`kvrt.commands` that defines ``HELP`` (one line),
optionally ``DESCRIPTION`` (what ``--help`` prints, in plain words), ``add_arguments(parser)``
and ``run(args) -> int``; they are discovered, so a new subcommand is a new file. Every
option's default is shown in ``--help``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

import kvrt.commands
from kvrt.errors import KvrtError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrt", description=kvrt.__doc__.splitlines()[0] if kvrt.__doc__ else None)
    parser.add_argument("--version", action="version", version=f"kvrt {kvrt.__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: llama.cpp's too)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(kvrt.commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue  # shared by commands, not one itself
        module = importlib.import_module(f"kvrt.commands.{info.name}")
        name = info.name.replace("_", "-")
        command = sub.add_parser(name, help=module.HELP, description=getattr(module, "DESCRIPTION", module.HELP),
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(command)
        command.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 1)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvrt.llama").setLevel(logging.DEBUG if args.verbose >= 2 else logging.ERROR)
    try:
        return int(args.handler(args) or 0)
    except KvrtError as exc:
        print(f"kvrt: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


import kvrt  # noqa: E402  (for the version and description above)

if __name__ == "__main__":
    sys.exit(main())
