"""The docs say what the code does (issue 27, item 16): the README's transcripts carry the
fields the commands print, sizes are MiB everywhere, USAGE.md's table of contents lists every
section, and ``--help`` shows no reStructuredText markup."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import ckstore
from ckstore import cli
from tests.support.paths import REPO

ROOT = REPO
README = (ROOT / "README.md").read_text()
USAGE = (ROOT / "docs" / "USAGE.md").read_text()


def _transcript_keys(command: str) -> list[str]:
    """The ``key:`` lines under ``$ ckstore COMMAND`` in the README's demo transcript."""
    block = README.split(f"$ ckstore {command}\n", 1)[1].split("\n\n", 1)[0].split("```", 1)[0]
    return [line.split(":", 1)[0] for line in block.splitlines() if line.strip()]


def _printed_keys(capsys, *argv: str) -> list[str]:
    assert cli.main(list(argv)) in (0, 1)
    return [
        line.split(":", 1)[0]
        for line in capsys.readouterr().out.splitlines()
        if not line.startswith(" ")
    ]


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    path = tmp_path / "s"
    with ckstore.open(path, create=True, chunk_bytes=1024) as store:
        for step in (1, 2):
            store.take(
                {"m": ckstore.StateDict(w=torch.arange(1024.0) * step)}, run="demo", step=step
            )
    return path


def test_readme_check_and_gc_transcripts_match_the_output(store_path, capsys) -> None:
    s = ("--store", str(store_path))
    assert _transcript_keys("check --read-data") == _printed_keys(
        capsys, *s, "check", "--read-data"
    )  # the note on what the chunk counts count included: the README shows it
    printed = _printed_keys(capsys, *s, "gc", "--keep-last", "1", "--grace", "0s")
    assert _transcript_keys("gc --keep-last 1 --grace 0s") == [
        k for k in printed if not k.startswith("note")
    ]


def test_sizes_are_binary_units_in_the_demo_and_the_cli() -> None:
    demo = README[README.index("## Demo output") :]
    assert not re.search(r"\d MB\b", demo), "the demo prints KiB/MiB like the rest of the CLI"
    assert "MiB" in demo


def test_usage_table_of_contents_lists_every_section() -> None:
    toc = USAGE.split("## Stores and snapshots", 1)[0]
    for title in re.findall(r"^## (.+)$", USAGE, flags=re.M):
        anchor = re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")
        assert f"(#{anchor})" in toc, f"USAGE.md's contents lack section {title!r}"


def test_help_has_no_rst_markup(capsys) -> None:
    for argv in [["--help"]] + [[c.name, "--help"] for c in cli.COMMANDS]:
        with pytest.raises(SystemExit):
            cli.main(argv)
        out = capsys.readouterr().out
        assert "``" not in out, argv
