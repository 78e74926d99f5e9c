"""The frozen stores in ``data/stores/``, one per index revision, and how they were made.

``data/stores/<revision>/`` is a whole local store (``ckstore.json``, packs, manifests and its
``index.sqlite``) as the ckstore release whose newest index revision was ``<revision>`` wrote
it, and ``data/stores/<revision>.json`` is what that release read back from it: its runs, tags,
snapshots (id, run, step, name, parent, metadata), each snapshot's state as restored (a SHA-256
of every tensor's bytes, every plain value) and, from 0006, its remotes (from 0007 with the id
of each one's store).
``test_frozen_revisions.py`` upgrades a copy of each with today's code and checks that nothing
of it is lost and that every snapshot still restores bit for bit.

How a store was made: ``python tests/index/fixture_stores.py REVISION`` from the repository
root (in a git clone with its history) unpacks the package as it was at ``COMMITS[REVISION]``
(``git archive``) into a temporary folder, runs this same file there under that old package
(``--write``), and copies the store and its JSON here. The old code writes the store through
its public API only: ``ckstore.open``, ``take``, ``tag``, and what the revision added
(``delta_base`` from 0002, loose takes and ``compact`` from 0004, the health summary from
0005, remotes and ``push`` from 0006, the store id a first push records for its remote from
0007; 0008 added the count of diverged replicas, which only a distributed take records, so its
store holds what 0007's does, written by 0008's code).

Why the old code and not alembic's downgrade: a downgraded head database keeps rows, packs
and manifests only today's writer makes (payload digests, pack versions, manifest fields), so
it would never show that today's reader understands what old writers wrote. Old releases'
stores are what users hold; these are made the same way.

Determinism: ``--write`` fixes what would vary between runs before the old code runs: the
wall clock (``time.time`` reads a clock this script advances a minute per take), the random
bytes of store ids, session ids and pack nonces (``os.urandom`` and ``uuid.uuid4`` read a
seeded generator), the order of sets of strings (``PYTHONHASHSEED``), one thread each for
hashing and I/O, no background compaction. Afterwards the generator only rewrites the session
owners (``host:pid``) to ``frozen:0`` and copies the SQLite file into a self-contained one (no
WAL, 1 KiB pages) whose tables and indexes are created in name order (SQLAlchemy creates a
table's indexes in an order that varies between runs), with the same rows. Running it twice
gives the same bytes.

``fixture_data.py`` and ``fixture_data_0003.py`` are older, index-only frozen databases (rows
written through that revision's ``Index``, with no packs behind them) that other tests pin
edge cases on.

Never regenerate an existing revision's store: it stands for stores already out there. For a
new revision, add a commit to ``COMMITS`` (one whose newest revision it is; ``COMMITS`` names
the last such commit of each older revision, and for the head the commit its store was made
at) and what it added to ``_take_all``, then generate that one revision.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data" / "stores"

# index revision -> the commit of the release that wrote its store
COMMITS = {
    "0001": "558c6fc59991e2729765db3db21d58bd70be2777",
    "0002": "6e493afa78d82bf4c12439ed91037574c33fc20f",
    "0003": "2eb89523ed998b6caf4e4dbbb5d6b1ee5bbd2ea5",
    "0004": "85b0b0ea2d20760dee87e3d86f65876115796805",
    "0005": "2e338ec86e0ac366772cb20655b1975568cc9f75",
    "0006": "03875f58ac9abb332fa23637f5df3ae2d65c616b",
    "0007": "2ffdfab9c378f14404d323bc2ffb21c62910be50",
    "0008": "764382eae41205666c49c807ffc09248f2c74eb2",
}

# the knobs of every frozen store: small enough that a few tensors of a few hundred bytes take
# the multi-chunk, multi-pack and inline paths
KNOBS = {"chunk_bytes": 256, "pack_bytes": 1024, "inline_bytes": 64}
EPOCH = 1_764_000_000.0  # the frozen clock's first reading
SEED = 20261127


def store_path(revision: str) -> Path:
    """The frozen store of ``revision``."""
    return DATA / revision


def expected(revision: str) -> dict[str, Any]:
    """What the release of ``revision`` read back from its store (see the module docstring)."""
    loaded: dict[str, Any] = json.loads((DATA / f"{revision}.json").read_text())
    return loaded


def flat_digests(state: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A state dict flattened to ``a/b/c`` keys: tensors as dtype, shape and the SHA-256 of
    their bytes; every other value as it is."""
    import torch

    out: dict[str, Any] = {}
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_digests(value, f"{path}/"))
        elif isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            out[path] = {
                "dtype": str(value.dtype),
                "shape": list(value.shape),
                "sha256": hashlib.sha256(data.numpy().tobytes()).hexdigest(),
            }
        else:
            out[path] = value
    return out


# --- under the old code (--write) ---------------------------------------------------------------
def _freeze_randomness(clock: list[float]) -> None:
    """Makes the old code's clock and random bytes reproducible (see the module docstring)."""
    import random
    import time
    import uuid

    rng = random.Random(SEED)
    time.time = lambda: clock[0]
    os.urandom = rng.randbytes
    uuid.uuid4 = lambda: uuid.UUID(int=rng.getrandbits(128), version=4)
    os.environ.update(
        {"CKSTORE_THREADS": "1", "CKSTORE_IO_THREADS": "1", "CKSTORE_AUTO_COMPACT": "0"}
    )


def _state(step: int) -> dict[str, Any]:
    """The app_state at ``step``: float, bfloat16, integer and bool tensors (chunked and
    inline) and plain values. Between steps the floats move in their low mantissa bits only
    (so deltas pay), the embedding stays (so its chunks dedup) and the counts change."""
    import torch

    from ckstore import StateDict

    gen = torch.Generator().manual_seed(SEED)
    weight = torch.randn(16, 8, generator=gen)
    emb = torch.randn(8, 32, generator=gen).to(torch.bfloat16)
    bits = weight.view(torch.int32) + (step // 100 - 1) * (weight.view(torch.int32) & 3)
    model = StateDict(
        weight=bits.view(torch.float32).clone(),
        bias=torch.arange(8, dtype=torch.float32) * step,
        emb=emb,
        counts=torch.arange(40, dtype=torch.int64) + step,
        mask=torch.arange(100) % 3 == step % 3,
    )
    optim = StateDict(step=step, lr=1e-4 * step, betas=[0.9, 0.95], schedule="cosine")
    return {"model": model, "optim": optim}


def _take_all(store: Any, revision: str, tick: Callable[[], None]) -> dict[str, Any]:
    """Every snapshot, tag and remote of ``revision``'s store, with that revision's API;
    returns what each take was given, by snapshot id, as :func:`flat_digests`."""
    rev = int(revision)
    delta = {"delta_base": "parent"} if rev >= 2 else {}
    takes = [
        (_state(100), {"run": "sft", "step": 100, "metadata": {"loss": 2.5}}),
        (_state(200), {"run": "sft", "step": 200, "tags": ["best"], "name": "sft-final", **delta}),
        (_state(300), {"run": "lora/x", "metadata": {"base": "sft-final"}}),
    ]
    if rev >= 5:  # the take's health summary: one snapshot records a NaN
        nan = _state(400)
        nan["model"]["weight"][0, 0] = float("nan")
        takes.append((nan, {"run": "sft", "step": 400, "on_nonfinite": "ignore"}))
    given = {}
    for state, options in takes:
        tick()
        given[store.take(state, **options).id] = flat_digests(state)
    tick()
    store.tag("lora/x", "v1.0")
    if rev >= 4:  # the older snapshots' loose chunks rewritten densely
        tick()
        store.compact()
    if rev >= 6:
        tick()
        store.add_remote("mirror", "memory://frozen-mirror")
        # from 0007 on, adding a remote reads its store id: an endpoint on loopback that
        # refuses at once stands for a remote that is not reachable now (nothing leaves the host)
        here = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}} if rev >= 7 else {}
        store.add_remote(
            "archive",
            "s3://bucket/ckpts",
            index="postgresql://user@db.example/ckpts",
            storage_options={"anon": True, **here},
        )
        tick()
        store.push("mirror", ["best"])
    return given


def _read_back(store: Any) -> dict[str, Any]:
    """What the store holds, read with the code that wrote it."""
    snapshots = store.log()
    view: dict[str, Any] = {
        "runs": store.runs(),
        "tags": store.tags(),
        "snapshots": [
            {
                "id": s.id,
                "run": s.run,
                "step": s.step,
                "name": s.name,
                "parent_id": s.parent_id,
                "created_at": s.created_at,
                "metadata": s.metadata,
            }
            for s in snapshots
        ],
        "state": {
            s.id: {
                key: value
                for top in ("model", "optim")
                for key, value in flat_digests(s.get_state_dict_for_key(top), f"{top}/").items()
            }
            for s in snapshots
        },
    }
    if hasattr(store, "remotes"):
        view["remotes"] = [
            {"name": r.name, "url": r.url, "index": r.index, "options": r.options, "tier": r.tier}
            | ({"store_id": r.store_id} if hasattr(r, "store_id") else {})
            for r in store.remotes()
        ]
    return view


def _write(revision: str, out: Path) -> None:
    """Writes ``revision``'s store at ``out`` and its JSON beside it (run under the old code)."""
    clock = [EPOCH]
    _freeze_randomness(clock)
    import warnings

    import ckstore

    def tick() -> None:
        clock[0] += 60.0

    if not ckstore.__file__ or not ckstore.__file__.startswith(os.environ["PYTHONPATH"]):
        raise RuntimeError(f"--write runs under the old package, not {ckstore.__file__}")
    warnings.simplefilter("ignore")  # the NaN the 0005 store records, old deprecations
    store = ckstore.open(out, create=True, **KNOBS)
    given = _take_all(store, revision, tick)
    view = _read_back(store)
    if view["state"] != given:
        raise AssertionError(f"revision {revision}'s code restored other bytes than it took")
    store.close()
    view["revision"], view["commit"] = revision, COMMITS[revision]
    Path(f"{out}.json").write_text(json.dumps(view, indent=1, sort_keys=True) + "\n")


# --- the generator ------------------------------------------------------------------------------
def generate(revision: str) -> None:
    """Makes ``data/stores/<revision>`` and its JSON with the code of ``COMMITS[revision]``."""
    repo = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        old.mkdir()
        archive = subprocess.run(
            ["git", "archive", COMMITS[revision], "ckstore"],
            cwd=repo,
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        out = Path(tmp) / revision
        env = {**os.environ, "PYTHONPATH": str(old), "PYTHONHASHSEED": "0"}
        subprocess.run(
            [sys.executable, __file__, "--write", revision, str(out)], env=env, cwd=tmp, check=True
        )
        _settle(out / "index.sqlite")
        target = store_path(revision)
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(out, target)
        shutil.copyfile(f"{out}.json", DATA / f"{revision}.json")


def _settle(index: Path) -> None:
    """Rewrites the index as one self-contained SQLite file (no WAL, 1 KiB pages) that names no
    host or process, its tables and indexes created in name order, the rows as they were."""
    with sqlite3.connect(index) as conn:
        conn.execute("UPDATE sessions SET owner = 'frozen:0'")
        query = (
            "SELECT name, sql FROM sqlite_master WHERE type = ? AND sql IS NOT NULL ORDER BY name"
        )
        tables = conn.execute(query, ("table",)).fetchall()
        indexes = conn.execute(query, ("index",)).fetchall()
    conn.close()
    rebuilt = index.with_name("rebuilt.sqlite")
    out = sqlite3.connect(rebuilt)
    out.execute("PRAGMA page_size=1024")
    out.execute("ATTACH DATABASE ? AS old", (str(index),))
    for name, sql in tables:
        out.execute(sql)
        out.execute(f'INSERT INTO main."{name}" SELECT * FROM old."{name}" ORDER BY rowid')
    for _, sql in indexes:
        out.execute(sql)
    out.commit()
    out.execute("DETACH DATABASE old")
    out.execute("VACUUM")
    out.close()
    os.replace(rebuilt, index)


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs="*", help="index revisions to generate")
    parser.add_argument("--write", nargs=2, metavar=("REVISION", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        _write(args.write[0], Path(args.write[1]))
        return
    for revision in args.revisions:
        generate(revision)


if __name__ == "__main__":
    _main()
