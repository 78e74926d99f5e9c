"""Long CLI work shows a progress bar on a terminal, and nothing extra when piped."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios

import torch

import ckstore


def _store(path):
    s = ckstore.open(path, chunk_bytes=1024, pack_bytes=4096, create=True)
    s.take({"s": ckstore.StateDict(w=torch.randn(128, 64))}, run="r")
    s.close()


def _on_terminal(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd`` with stderr on a pseudo-terminal 100 columns wide: its exit code and what it drew."""
    leader, follower = pty.openpty()
    # a real terminal has a size; a fresh pty reports 0 columns, and a bar 0 wide is empty
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(cmd, stderr=follower, stdout=subprocess.DEVNULL)
    os.close(follower)
    chunks = []
    while True:  # read while the child runs: a pty drops what is unread once it closes
        ready, _, _ = select.select([leader], [], [], 0.2)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the terminal closed
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(leader)
    proc.wait(timeout=120)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def test_check_read_data_shows_progress_on_a_terminal_only(tmp_path):
    _store(tmp_path / "s")
    cmd = [
        sys.executable,
        "-m",
        "ckstore.cli",
        "--store",
        str(tmp_path / "s"),
        "check",
        "--read-data",
    ]
    code, terminal = _on_terminal(cmd)
    assert code == 0, terminal
    assert "packs" in terminal and ("it/s" in terminal or "%|" in terminal), terminal
    piped = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and piped.stderr == ""


def test_push_shows_progress_on_a_terminal_and_figures_under_json(tmp_path):
    _store(tmp_path / "s")
    with ckstore.open(tmp_path / "s") as s:
        s.add_remote("a", tmp_path / "a")
        s.add_remote("b", tmp_path / "b")
    ck = [sys.executable, "-m", "ckstore.cli", "--store", str(tmp_path / "s")]
    code, terminal = _on_terminal([*ck, "push", "a"])
    assert code == 0 and "push" in terminal and "%|" in terminal, terminal
    piped = subprocess.run(
        [*ck, "push", "b", "--json"], capture_output=True, text=True, timeout=120
    )
    assert piped.returncode == 0 and piped.stderr == ""
    import json

    figures = json.loads(piped.stdout)
    assert (
        figures["chunks_sent"] > 0 and figures["bytes_sent"] > 0 and figures["chunks_skipped"] == 0
    )
