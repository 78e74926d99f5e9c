"""Shell completion: ``ckstore completion bash|zsh|fish`` prints a script; the script asks
``ckstore __complete WORDS...`` for candidates at every TAB.

All the logic is here, in one place for the three shells: the scripts only pass the words
typed so far (the last one is the word being completed, possibly empty) and show the lines
printed back. Commands, options and what each command's positional arguments are (its
record's ``completes``, ``cli/_command.py``) come from the parser itself; refs (tags, runs,
``run@step``, snapshot names) and keys come from the store the command line names
(``--store``, ``$CKSTORE_STORE``, or the nearest store upwards), read from the index only, so
a TAB never imports torch. ``__files__`` asks the shell for its own file completion.
Completion never fails loudly: any error yields no candidates.

Keys complete one path level at a time (:func:`next_level`), at ``/`` and at ``.``: a 7B
model's thousands of keys come as ``model/`` first, then ``model/model.``, then
``model/model.layers.``, and so on; a candidate that ends in a separator leaves no space after
it, so the next TAB goes on from there.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._command import Command

COMPLETE = "__complete"
"""The hidden command the scripts call."""
FILES = "__files__"
"""The answer that makes the shell complete file names itself."""

OPTION_VALUES = {
    "--store": "file", "--run": "run", "--delete": "tag", "-d": "tag", "--delta-base": "ref",
    "--tag": "tag",
}  # fmt: skip
SHELLS = ("bash", "zsh", "fish")

BASH = """\
# ckstore completion for bash. Load it in ~/.bashrc with:  eval "$(ckstore completion bash)"
_ckstore_complete() {
    local IFS=$'\\n' out
    out=$(ckstore __complete "${COMP_WORDS[@]:1:COMP_CWORD}" 2>/dev/null)
    if [ "$out" = "__files__" ]; then
        COMPREPLY=($(compgen -f -- "${COMP_WORDS[COMP_CWORD]}"))
    else
        COMPREPLY=($out)
        # a key's next level (model/, model/layers.) goes on without a space
        if [ ${#COMPREPLY[@]} -eq 1 ] && [[ "${COMPREPLY[0]}" == */ || "${COMPREPLY[0]}" == *. ]]; then
            compopt -o nospace 2>/dev/null
        fi
    fi
}
complete -o default -F _ckstore_complete ckstore
"""
ZSH = """\
#compdef ckstore
# ckstore completion for zsh. Load it in ~/.zshrc (after compinit) with:
#   eval "$(ckstore completion zsh)"
_ckstore() {
    local out
    out=$(ckstore __complete "${(@)words[2,CURRENT]}" 2>/dev/null)
    if [[ "$out" == "__files__" ]]; then
        _files
        return
    fi
    local -a candidates levels
    candidates=("${(@f)out}")
    levels=(${(M)candidates:#*[./]})
    candidates=(${candidates:#*[./]})
    compadd -Q -- "${candidates[@]}"
    compadd -Q -S '' -- "${levels[@]}"
}
compdef _ckstore ckstore
"""
FISH = """\
# ckstore completion for fish. Load it with:  ckstore completion fish | source
# (or save it as ~/.config/fish/completions/ckstore.fish)
function __ckstore_complete
    set -l words (commandline -opc)
    set -l current (commandline -ct)
    set -l out (ckstore __complete $words[2..-1] "$current" 2>/dev/null)
    if test "$out" = "__files__"
        __fish_complete_path "$current"
    else
        printf '%s\\n' $out
    end
end
complete -c ckstore -f -a '(__ckstore_complete)'
"""
SCRIPTS = {"bash": BASH, "zsh": ZSH, "fish": FISH}


def script(shell: str) -> str:
    """The completion script for ``shell`` (one of :data:`SHELLS`)."""
    return SCRIPTS[shell]


def cmd_completion(args: argparse.Namespace) -> int:
    print(script(args.shell), end="")
    return 0


def _completion_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")


COMPLETION = Command(
    "completion",
    "print a shell completion script (bash, zsh, fish)",
    (
        'eval "$(ckstore completion bash)"',
        'eval "$(ckstore completion zsh)"',
        "ckstore completion fish | source",
    ),
    cmd_completion,
    _completion_arguments,
    description=(
        "Print a completion script for bash, zsh or fish: subcommands, options, refs (tags, runs, "
        'run@step) and keys completed from the store. bash: add `eval "$(ckstore completion '
        'bash)"` to ~/.bashrc; zsh: `eval "$(ckstore completion zsh)"` after compinit in '
        "~/.zshrc; fish: `ckstore completion fish | source`, or save it as "
        "~/.config/fish/completions/ckstore.fish."
    ),
    completes=("shell",),
)


def main(words: Sequence[str], parser: argparse.ArgumentParser) -> int:
    """``ckstore __complete WORDS...``: print the candidates for the last word, one a line."""
    try:
        found = candidates(list(words) or [""], parser)
    except Exception:  # noqa: BLE001 - a TAB must never print an error
        found = []
    try:
        if found:
            print("\n".join(found), flush=True)
    except BrokenPipeError:  # the shell stopped reading
        sys.stderr.close()
    return 0


def candidates(words: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """What may follow ``words[:-1]`` and starts with ``words[-1]``."""
    *before, current = words
    commands = _subcommands(parser)
    command, positionals, store, pending = _scan(before, parser, commands)
    if pending is not None:  # the value of an option
        return _values(OPTION_VALUES.get(pending, ""), current, store, positionals)
    if current.startswith("-"):
        sub = commands.get(command) if command else None
        return _match(_options(sub if sub is not None else parser), current)
    if command is None:
        return _match(sorted(c for c in commands if not c.startswith("_")), current)
    kinds: tuple[str, ...] = commands[command].get_default("completes") or ()
    n = len(positionals)
    kind = kinds[min(n, len(kinds) - 1)] if kinds else ""
    if kind.endswith("*"):
        kind = kind[:-1]
    elif n >= len(kinds):
        return []
    return _values(kind, current, store, positionals)


def _scan(
    words: list[str], parser: argparse.ArgumentParser, commands: dict[str, argparse.ArgumentParser]
) -> tuple[str | None, list[str], list[str], str | None]:
    """The command, its positional words, the store options given, and an option still
    waiting for its value (None if none)."""
    command: str | None = None
    positionals: list[str] = []
    store: list[str] = []
    i = 0
    while i < len(words):
        w = words[i]
        if (
            w.startswith("-")
            and "=" not in w
            and _takes_value(w, commands[command] if command else parser)
        ):
            if i + 1 == len(words):
                return command, positionals, store, w
            if w in ("--store", "--index", "-o", "--storage-option"):
                store += [w, words[i + 1]]
            i += 2
            continue
        if w.startswith("--store=") or w.startswith("--index="):
            store.append(w)
        elif not w.startswith("-"):
            if command is None and w in commands:
                command = w
            elif command is not None:
                positionals.append(w)
        i += 1
    return command, positionals, store, None


def _takes_value(option: str, parser: argparse.ArgumentParser) -> bool:
    """Whether ``option`` must be followed by a value (an optional one, ``nargs="?"``, is not)."""
    for action in parser._actions:
        if option in action.option_strings:
            return action.nargs not in (0, "?")
    return False


def _values(kind: str, current: str, store: list[str], positionals: list[str]) -> list[str]:
    if kind == "file":
        return [FILES]
    if kind == "shell":
        return _match(list(SHELLS), current)
    if kind == "remote-action":
        return _match(["add", "list", "rm"], current)
    if kind in ("ref", "run", "tag", "key", "remote"):
        return _from_store(kind, current, store, positionals)
    return []


def _from_store(
    kind: str, current: str, store_args: list[str], positionals: list[str]
) -> list[str]:
    from .. import open as open_store
    from ._common import find_store

    explicit = _option(store_args, "--store")
    with open_store(
        find_store(explicit), index=_option(store_args, "--index"), read_only=True
    ) as store:
        if kind == "run":
            return _match(store.runs(), current)
        if kind == "tag":
            return _match(list(store.tags()), current)
        if kind == "remote":
            return _match([r.name for r in store.remotes()], current)
        if kind == "key":
            if not positionals:
                return []
            return next_level([e.key for e in store.get(positionals[0]).entries()], current)
        if "@" in current:
            run = current.rpartition("@")[0]
            steps = [s.step for s in store.log(run=run, limit=200) if s.step is not None]
            return _match([f"{run}@{step}" for step in sorted(set(steps))], current)
        names = list(store.tags()) + store.runs()
        names += [s.name for s in store.log(limit=200) if s.name]
        return _match(sorted(set(names)), current)


def _option(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(p: argparse.ArgumentParser) -> list[str]:
    return sorted({o for a in p._actions for o in a.option_strings if o.startswith("--")})


SEPARATORS = "/."
"""Where a key's path levels end: ``/`` between state dicts, ``.`` inside a module's names."""


def next_level(keys: list[str], current: str) -> list[str]:
    """The keys that start with ``current``, cut after their next separator (``model/``,
    ``model/layers.``), each once, sorted: one level at a time. A key with no separator
    left comes whole."""
    out = set()
    for key in keys:
        if not key.startswith(current):
            continue
        rest = key[len(current) :]
        cut = min((i for i in (rest.find(c) for c in SEPARATORS) if i >= 0), default=-1)
        out.add(key if cut < 0 else current + rest[: cut + 1])
    return sorted(out)


def _match(items: list[str], prefix: str) -> list[str]:
    return [i for i in items if i.startswith(prefix)]
