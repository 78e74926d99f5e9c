"""The ``import`` and ``export`` commands: checkpoints in and out of the store (each one record,
``cli/_command.py``, beside its handler).

torch is imported only when these commands run (through the store's import and export), so
the read commands stay light.
"""

from __future__ import annotations

import argparse

from . import _format as fmt
from ._args import REF_HELP, nonneg_int, size_arg
from ._command import Command
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
            progress=fmt.bar("import"),
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


def _import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a .safetensors or torch.save file, a Hugging Face or DCP folder")
    p.add_argument("--run", default="default", help="run to add the snapshot to (default: default)")
    p.add_argument("--step", type=nonneg_int, help="the snapshot's step")
    p.add_argument(
        "--tag",
        dest="tags",
        action="append",
        default=[],
        metavar="T",
        help="tag it (repeatable)",
    )
    p.add_argument(
        "--move-tags",
        action="store_true",
        help="move a --tag that exists already (refused otherwise, as `ckstore tag` without --force)",
    )
    p.add_argument("--name", help="a unique snapshot name")
    p.add_argument(
        "--format",
        choices=("safetensors", "hf", "torch", "dcp"),
        help="the checkpoint's format (default: detected)",
    )
    p.add_argument(
        "--delta-base",
        metavar="REF",
        help="store changed tensors as deltas against this snapshot where smaller (e.g. the base "
        "model a fine-tune started from; 'parent': the run's latest snapshot)",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="import even if the files do not match the ckstore digests they carry (checked by default)",
    )
    p.add_argument(
        "--on-nonfinite",
        choices=("warn", "raise", "ignore"),
        default="warn",
        help="a tensor holding NaN or Inf: warn and import (default), refuse, or say nothing",
    )


IMPORT = Command(
    "import",
    "take a safetensors, Hugging Face, torch.save or DCP checkpoint into the store",
    (
        "ckstore import ./model.safetensors --run base --step 0",
        "ckstore import ./hf-model-folder --run base --tag llama-1b",
        "ckstore import ./ckpt.pt --run sft --step 1000 --format torch",
        "ckstore import ./dcp-checkpoint-dir --run titan --step 500",
        "ckstore import ./finetuned-folder --run sft --delta-base base",
    ),
    cmd_import,
    _import_arguments,
    completes=("file",),
)


def cmd_export(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        snap = store.get(args.ref)
        report = snap.export(
            args.dir,
            args.format,
            keys=args.keys,
            force=args.force,
            shard_bytes=args.shard_size,
            progress=fmt.bar("export"),
        )
    out = {"snapshot": snap.ref, **report.to_dict()}
    print_report(out, args.json)
    if report.skipped_apps and not args.json:
        print(
            f"note: left out {', '.join(report.skipped_apps)} (not the model's weights: a "
            f"{args.format} export holds what from_pretrained loads); --keys '**' exports "
            "every app"
        )
    return EXIT_OK


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ref", help=REF_HELP)
    p.add_argument("dir", help="directory to write (must be missing or empty, unless --force)")
    p.add_argument(
        "--format",
        choices=("safetensors", "hf", "torch", "dcp"),
        default="safetensors",
        help="safetensors/hf: Hugging Face folder (default); torch: one torch.save file; dcp: a DCP directory",
    )
    p.add_argument(
        "--keys",
        action="append",
        metavar="GLOB",
        help="only keys matching this glob, e.g. 'model/**' (repeatable)",
    )
    p.add_argument(
        "--force", action="store_true", help="replace a non-empty directory (never a store)"
    )
    p.add_argument(
        "--shard-size",
        type=size_arg,
        metavar="SIZE",
        help="largest safetensors shard (default 5e9 bytes, Hugging Face's 5GB; e.g. 2GiB)",
    )


EXPORT = Command(
    "export",
    "write a snapshot as a Hugging Face folder, a torch.save file or a DCP directory",
    (
        "ckstore export best ./hf-out",
        "ckstore export sft@1000 ./weights --keys 'model/**' --shard-size 2GB",
        "ckstore export sft ./ckpt --format torch",
        "ckstore export sft ./dcp-out --format dcp --force",
    ),
    cmd_export,
    _export_arguments,
    completes=("ref", "file"),
)
