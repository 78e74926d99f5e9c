"""The measured phases, in the order a run goes through them; ``--skip`` and ``--only`` name
them. ``STATE_FREE``: the phases that do not use the synthetic state (``Bench.state``)."""

from __future__ import annotations

from collections.abc import Callable

from ..harness import Bench
from .budget import budget
from .bytes_over_saves import bytes_over_saves
from .minilm import minilm
from .overhead import overhead
from .peak_rss import peak_rss
from .profile import profile
from .resume import resume
from .rounds import run_rounds
from .training import training

PHASES: list[tuple[str, Callable[[Bench], None]]] = [
    ("rounds", run_rounds),
    ("bytes", bytes_over_saves),
    ("rss", peak_rss),
    ("budget", budget),
    ("resume", resume),
    ("minilm", minilm),
    ("profile", profile),
    ("training", training),
    ("overhead", overhead),
]
STATE_FREE = frozenset({"minilm", "training", "overhead"})
