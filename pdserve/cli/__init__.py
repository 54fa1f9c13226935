"""``pdserve`` command line: ``serve``, ``server``, ``decode-worker``, ``prefill-worker``,
``pull``, ``generate``, ``bench``, ``local-cluster``, ``train-eagle``, ``quantize``.

Each subcommand's flags and handler live in a module of this package (``serve`` holds the
four that run a cluster's processes); :func:`build_parser` puts them together in the order
``pdserve --help`` lists them."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve.cli.bench import add_bench_parser
from pdserve.cli.generate import add_generate_parser
from pdserve.cli.local_cluster import add_local_cluster_parser
from pdserve.cli.pull import add_pull_parser
from pdserve.cli.serve import add_serve_parser, add_server_parser, add_worker_parsers
from pdserve.cli.train_eagle import add_train_eagle_parser


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says it, the
    option is required, its default is None (the help says what leaving it out does) or it
    is an on/off switch (``--no-core-turns (default: True)`` read as if the flag were on)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and ("default:" in action.help or action.required
                            or action.default is None or action.nargs == 0):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The ``pdserve`` parser: ``--log-level`` and one subparser per command, each with
    its handler as the ``func`` default and every help showing its defaults."""
    from pdserve.offline.quantize.command import add_quantize_parser

    parser = argparse.ArgumentParser(prog="pdserve", description=(
        "OpenAI-compatible LLM serving with disaggregated prefill and decode"),
        formatter_class=_HelpFormatter)
    parser.add_argument("--log-level", default="WARNING",
                        help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in (add_pull_parser, add_serve_parser, add_server_parser,
                       add_worker_parsers, add_generate_parser, add_local_cluster_parser,
                       add_bench_parser, add_train_eagle_parser, add_quantize_parser):
        add_parser(sub)
    for p in sub.choices.values():
        p.formatter_class = _HelpFormatter
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``pdserve ARGV`` (default: ``sys.argv[1:]``) and return its exit status: 2 with
    a one-line ``pdserve: error:`` on a bad file or value, 130 on Ctrl-C."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
