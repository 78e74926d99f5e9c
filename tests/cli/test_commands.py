"""One command is one record beside its handler (issue 30, item 3): ``cli.COMMANDS`` lists the
records, the parser is built from them alone, and a record carries everything ``--help`` and
completion say about its command."""

from __future__ import annotations

import argparse

import pytest

from ckstore import cli
from ckstore.cli import _complete
from ckstore.cli._args import Parser
from ckstore.cli._command import Command

KINDS = {"ref", "key", "tag", "run", "remote", "remote-action", "shell", "file"}


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_the_parser_is_the_records() -> None:
    names = [c.name for c in cli.COMMANDS]
    assert len(set(names)) == len(names)
    subs = _subparsers(cli.build_parser())
    assert list(subs) == names
    for command in cli.COMMANDS:
        sp = subs[command.name]
        assert sp.get_default("func") is command.run and sp.get_default("parser") is sp
        assert sp.get_default("completes") == command.completes
        assert sp.epilog is not None and all(e in sp.epilog for e in command.examples)


@pytest.mark.parametrize("command", cli.COMMANDS, ids=lambda c: c.name)
def test_each_record_is_complete(command: Command) -> None:
    assert command.help and "\n" not in command.help and not command.help.endswith(".")
    assert command.help[0].islower()
    assert command.examples and all("ckstore " in e for e in command.examples)
    assert "``" not in command.description  # plain text: --help shows no markup
    kinds = [k.rstrip("*") for k in command.completes]
    assert set(kinds) <= KINDS, kinds
    assert all(not k.endswith("*") for k in command.completes[:-1])  # only the last repeats


def test_a_new_command_is_one_record(capsys: pytest.CaptureFixture[str]) -> None:
    """What adding a command takes: a record (here a toy one) gives its parser, help, examples,
    arguments, completion kinds and handler; ``main`` reaches every handler as ``args.cli``."""
    ran: list[argparse.Namespace] = []

    def run(args: argparse.Namespace) -> int:
        ran.append(args)
        return 0

    def arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("ref", help="the snapshot")

    toy = Command("toy", "do a toy thing", ("ckstore toy sft",), run, arguments, completes=("ref",))
    root = Parser(prog="ckstore")
    sub = root.add_subparsers(dest="command", required=True, parser_class=Parser)
    toy.add_to(sub, cli.main)
    args = root.parse_args(["toy", "sft@1", "--json"])
    assert args.func(args) == 0 and ran[0].ref == "sft@1" and ran[0].json
    assert args.cli is cli.main and args.completes == ("ref",)
    with pytest.raises(SystemExit):
        root.parse_args(["toy", "--help"])
    out = capsys.readouterr().out
    assert "Do a toy thing." in out and "  ckstore toy sft" in out and "--store URL" in out
    assert _complete.candidates(["toy", "--j"], root) == ["--json"]
