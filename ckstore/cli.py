"""The ``ckstore`` command line (git-like subcommands)."""

from __future__ import annotations

import argparse
import sys

from . import demo as demo_mod


def _cmd_demo(args: argparse.Namespace) -> int:
    return demo_mod.main(args.store or "./demo-store", steps=args.steps, every=args.every)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckstore", description="Content-addressed, versioned checkpoint store for PyTorch.")
    p.add_argument("--store", help="store URL (default: $CKSTORE_STORE, then the nearest store upwards)")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a small model, snapshot it, resume bit-exactly in a fresh process")
    d.add_argument("--steps", type=int, default=40)
    d.add_argument("--every", type=int, default=5)
    d.set_defaults(func=_cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
