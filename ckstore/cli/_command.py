"""One ``ckstore`` command as one record, kept beside its handler: its name, help, examples,
arguments, what its positional arguments complete to, and the handler that runs it.

``cli/__init__.py`` lists the records (``COMMANDS``, in ``--help`` order) and builds the parser
from them; shell completion reads a command's positional kinds from its parser. Adding a
command is one :class:`Command` in the module of its handler, its line in ``COMMANDS``, and its
test.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._args import STORE_HELP, common_options

Handler = Callable[[argparse.Namespace], int]
"""A command's run: its parsed arguments in, its exit code out. Errors are raised (``main``
turns a ckstore error into its exit code and one line on stderr)."""
CliMain = Callable[[list[str]], int]
"""The command line's ``main``: every handler finds it as ``args.cli``, to run other commands
in this process (the demo does)."""


def no_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of a command that takes only the common options (none)."""


@dataclass(frozen=True)
class Command:
    """One subcommand of ``ckstore``, whole.

    Attributes:
        name: What users type (``ckstore NAME``).
        help: One line, lower case, no full stop: what ``ckstore --help`` lists.
        examples: Command lines ``ckstore NAME --help`` shows under "examples:".
        run: The handler.
        arguments: Adds the command's own arguments and options to its parser (the common
            ones, ``--store``, ``--index``, ``-o``, ``--json``, ``--read-only``, are added
            for it).
        description: What ``ckstore NAME --help`` says first, as plain text (no markup);
            default: ``help`` as a sentence.
        store_help: The help of its ``--store``, where the store means something else.
        completes: What each positional argument is, for shell completion: ``ref``, ``key``,
            ``tag``, ``run``, ``remote``, ``remote-action``, ``shell`` or ``file``; a last one
            ending in ``*`` repeats.
    """

    name: str
    help: str
    examples: tuple[str, ...]
    run: Handler
    arguments: Callable[[argparse.ArgumentParser], None] = no_arguments
    description: str = ""
    store_help: str = STORE_HELP
    completes: tuple[str, ...] = ()

    def add_to(self, commands: Any, cli: CliMain) -> argparse.ArgumentParser:
        """Add this command's parser to ``commands`` (the subparsers of ``ckstore``)."""
        parser: argparse.ArgumentParser = commands.add_parser(
            self.name,
            help=self.help,
            description=textwrap.fill(
                self.description or self.help[0].upper() + self.help[1:] + "."
            ),
            epilog="examples:\n" + "\n".join(f"  {e}" for e in self.examples),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            parents=[common_options(True, store_help=self.store_help)],
        )
        self.arguments(parser)
        parser.set_defaults(func=self.run, parser=parser, completes=self.completes, cli=cli)
        return parser
