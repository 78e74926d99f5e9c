"""Run a trainer that never imports ckstore with ckstore's DCP selection installed.

Usage (exactly as ``python -m MODULE ...`` / ``python SCRIPT ...`` would run it)::

    python -m ckstore.dcp.launch -m torchtitan.train --job.config_file llama3_8b.toml
    python -m ckstore.dcp.launch train.py --steps 100
    torchrun --nproc_per_node=8 -m ckstore.dcp.launch -m torchtitan.train ...

It imports :mod:`ckstore` (which imports :mod:`ckstore.dcp` together with
``torch.distributed.checkpoint``, whenever the trainer imports it), then runs the module or the
script as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as Python sets them. From then on
``dcp.save`` / ``dcp.load`` of a path in a marked folder (:func:`ckstore.dcp.mark_folder`) and of
``ckstore://`` ids go to ckstore; everything else goes to DCP unchanged.

Why a launcher rather than a startup hook: ``torchrun -m`` runs any module on every rank, so
one word on the command line is all a torchtitan user changes, and nothing is installed into
the interpreter's start-up (a ``.pth`` hook would run in every Python process of the
environment).
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = (
    "usage: python -m ckstore.dcp.launch -m MODULE [ARGS...]\n"
    "       python -m ckstore.dcp.launch SCRIPT [ARGS...]\n"
    "Runs MODULE or SCRIPT as Python would, with dcp.save/dcp.load choosing ckstore for paths in\n"
    "folders marked with `ckstore mark-folder` and for ckstore:// ids."
)


def main(argv: list[str] | None = None) -> int:
    """Install ckstore's DCP selection, then run the module or script ``argv`` names.

    Returns:
        2 for a usage error; otherwise what the module or script does (its ``SystemExit``
        passes through), 0 when it returns.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        print(USAGE, file=sys.stderr if not args or args[0] == "-m" else sys.stdout)
        return 0 if args and args[0] in ("-h", "--help") else 2
    import ckstore  # noqa: F401  (arms ckstore.dcp for when DCP is imported)

    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]  # run_module sets argv[0] to the module's file
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        script = args[0]
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
