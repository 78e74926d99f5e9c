"""The ``import`` and ``export`` commands: checkpoints in and out of the store.

torch is imported only when these commands run (through the store's import and export), so
the read commands stay light.
"""

from __future__ import annotations

import argparse

from . import _format as fmt
from ._common import EXIT_OK, open_store, print_report


def cmd_import(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        snap = store.import_checkpoint(
            args.path,
            run=args.run,
            step=args.step,
            tags=args.tags,
            name=args.name,
            format=args.format,
            delta_base=args.delta_base,
            move_tags=args.move_tags,
            verify=not args.no_verify,
            on_nonfinite=args.on_nonfinite,
            progress=fmt.bar(),
        )
        report = {
            "id": snap.id,
            "snapshot": snap.ref,
            "run": snap.run,
            "step": snap.step,
            "tags": list(args.tags),
            "imported_from": snap.metadata.get("imported_from"),
            "healthy": snap.healthy,
            **snap.stats,
        }
    print_report(report, args.json)
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        snap = store.get(args.ref)
        report = snap.export(
            args.dir,
            args.format,
            keys=args.keys,
            force=args.force,
            shard_bytes=args.shard_size,
            progress=fmt.bar(),
        )
    out = {"snapshot": snap.ref, **report.to_dict()}
    print_report(out, args.json)
    return EXIT_OK
