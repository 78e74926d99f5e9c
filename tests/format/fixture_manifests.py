"""The frozen store of a distributed take whose manifest is one object (format version 1), as
the last release before manifests in parts wrote it, and what that release read back from it.

``data/manifest-v1/store/`` is a whole local store (``ckstore.json``, packs, manifests and its
``index.sqlite``, index revision 0006) that two ranks of the release at :data:`COMMIT` wrote
with one distributed take (run ``dist``, step 1): the DTensors of
``tests/distributed/scenarios.py`` (sharded, replicated, on a mesh, uneven, empty) and each
rank's per-rank values (a tensor and an int that differ by rank, a tensor and an int equal
everywhere), with the scenarios' small chunks. ``data/manifest-v1/expected.json`` holds the
snapshot's id and, per key, the SHA-256 of the bytes that release restored (each rank's own
for per-rank keys). ``test_frozen_manifests.py`` reads it with today's code, restores it (one
process, and two ranks into other placements), checks it, and takes the same state again.

How it was made: ``python tests/format/fixture_manifests.py`` from the repository root (a git
clone with its history) unpacks the package and the tests as they were at :data:`COMMIT`
(``git archive``) into a temporary folder and runs this file there (``--write``), on two forked
gloo ranks, then copies the store and its JSON here. Session ids and times differ between runs,
so its bytes do too: never regenerate it, it stands for stores already out there.
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
from pathlib import Path
from typing import Any

COMMIT = "0928b9b835f770f1c068bd2f5d8bf51fa441f176"
"""The last commit whose distributed takes wrote their manifest as one object."""
DATA = Path(__file__).resolve().parent / "data" / "manifest-v1"
RUN = "dist"


def sha(t: Any) -> str:
    """The SHA-256 of a tensor's bytes (C order)."""
    data = t.detach().cpu().contiguous().reshape(-1).view(dtype=__import__("torch").uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def _take(rank: int, world: int, path: str) -> dict[str, Any]:
    """One rank of the old code's take, then what it reads back (its own per-rank values)."""
    import ckstore
    from tests.distributed import scenarios as sc

    with ckstore.open(path, **sc.TINY, create=True) as store:
        app = {"g": ckstore.StateDict(sc.dtensors(world, True, False)), "local": sc.local_app(rank)}
        snap = store.take(app, run=RUN, step=1)
        local = {
            k: sha(v) if hasattr(v, "dtype") else v
            for k, v in snap.get_state_dict_for_key("local").items()
        }
    return {"id": snap.id, "local": local}


def _write(out: Path) -> None:
    """Write the store at ``out`` and its JSON beside it (run under the old code)."""
    import warnings

    import ckstore
    from tests.distributed import scenarios as sc
    from tests.support.ranks import run_ranks, values

    if not ckstore.__file__.startswith(os.environ["PYTHONPATH"]):
        raise RuntimeError(f"--write runs under the old package, not {ckstore.__file__}")
    warnings.simplefilter("ignore")
    got = values(run_ranks(_take, 2, out.parent, str(out)))
    with ckstore.open(out) as store:
        snap = store.get(f"{RUN}@1")
        version = json.loads(store.repository.objects.get_blob("manifests", snap.id))["version"]
    view = {
        "id": got[0]["id"],
        "commit": COMMIT,
        "manifest_version": version,
        "global": {k: sha(v) for k, v in sc.global_state().items()},
        "local": [r["local"] for r in got],
    }
    Path(f"{out}.json").write_text(json.dumps(view, indent=1, sort_keys=True) + "\n")


def generate() -> None:
    """Make ``data/manifest-v1`` with the code of :data:`COMMIT`."""
    repo = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        old.mkdir()
        archive = subprocess.run(
            ["git", "archive", COMMIT, "ckstore", "tests"],
            cwd=repo,
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        shutil.copy(__file__, old / "tests/format/fixture_manifests.py")  # this generator
        out = Path(tmp) / "work" / "store"
        out.parent.mkdir()
        env = {**os.environ, "PYTHONPATH": str(old), "CKSTORE_AUTO_COMPACT": "0"}
        subprocess.run(
            [sys.executable, str(old / "tests/format/fixture_manifests.py"), "--write", str(out)],
            cwd=old,
            env=env,
            check=True,
        )
        shutil.rmtree(DATA, ignore_errors=True)
        DATA.mkdir(parents=True)
        with sqlite3.connect(out / "index.sqlite") as db:  # self-contained: no WAL beside it
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            db.execute("PRAGMA journal_mode=DELETE")
        db.close()
        shutil.copytree(out, DATA / "store")
        shutil.copy(f"{out}.json", DATA / "expected.json")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--write", type=Path, help="(internal) write the store here, under the old code"
    )
    a = ap.parse_args()
    if a.write:
        _write(a.write)
    else:
        generate()
