"""Validation of run, tag and snapshot names (no crap in, no crap out)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from ckstore.errors import InvalidInputError

MAX_NAME_LENGTH = 128
_ALLOWED = re.compile(r"[A-Za-z0-9._/-]+")


def validate_name(name: str, what: str) -> str:
    """Checks a run, tag or snapshot name and returns it unchanged.

    A name is 1 to 128 characters of ``A-Z a-z 0-9 . _ / -``; it does not start or end with
    ``/``, does not start with ``-`` (it would read as a command-line option), and contains
    neither ``..`` nor ``//``. ``@`` is refused because it separates run and step in refs
    (``run@step``).

    Args:
        name: The name to check.
        what: What the name is for (``"tag"``, ``"run"``), used in the error message.

    Raises:
        InvalidInputError: Naming the name and the rule it breaks.
    """
    rule = _broken_rule(name)
    if rule is not None:
        raise InvalidInputError(f"invalid {what} name {name!r}: {rule}")
    return name


def _broken_rule(name: object) -> str | None:
    if not isinstance(name, str):
        return f"must be a string, not {type(name).__name__}"
    if not 1 <= len(name) <= MAX_NAME_LENGTH:
        return f"must be 1 to {MAX_NAME_LENGTH} characters long"
    if "@" in name:
        return "must not contain '@' (it separates run and step, as in run@100)"
    if not _ALLOWED.fullmatch(name):
        return "may only contain letters, digits and . _ / -"
    if name.startswith("/") or name.endswith("/"):
        return "must not start or end with '/'"
    if name.startswith("-"):
        return "must not start with '-'"
    if ".." in name:
        return "must not contain '..'"
    if "//" in name:
        return "must not contain '//'"
    return None


# Tags given to a commit are *specs* (``_refnames``): ``"name"`` creates the tag (refused if
# it is elsewhere), ``"+name"`` creates or moves it, as git's ``+refspec``.
MOVE = "+"


def tag_specs(names: Iterable[str], move: bool) -> tuple[str, ...]:
    """The specs of tag ``names`` for a commit: each may move when ``move`` is True."""
    return tuple(f"{MOVE}{n}" if move else n for n in names)


def parse_spec(spec: str) -> tuple[str, bool]:
    """``"+best"`` -> ``("best", True)``; ``"best"`` -> ``("best", False)``."""
    return (spec[len(MOVE) :], True) if spec.startswith(MOVE) else (spec, False)
