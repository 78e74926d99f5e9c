"""One adapter per system, all on the same S3 server: ``save(state, prefix, i)`` -> handle,
``restore(handle, dest)`` in place.

- ckstore: a store at ``s3://bucket/<prefix>/store`` (``storage_options`` carry the endpoint),
  its SQLite index in a local temp folder (one host; PostgreSQL is for many).
- DCP: ``dcp.save`` / ``dcp.load`` with ``FsspecWriter`` / ``FsspecReader`` (from
  ``torch.distributed.checkpoint._fsspec_filesystem``: torch 2.13 does not re-export them) on
  s3fs, the endpoint passed as fsspec keyword arguments (``client_kwargs``), ``thread_count``
  writer threads.
- TorchSnapshot: ``Snapshot.take(path="s3://...")``. Its S3 plugin ignores ``storage_options``
  and creates its aiobotocore client with no endpoint argument, so the endpoint reaches it only
  through botocore's ``AWS_ENDPOINT_URL_S3`` environment variable (set around each call).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from ..systems import TorchSnapshotApp
from .server import ObjectStore

SYSTEMS = ("ckstore", "dcp", "torchsnapshot")
TS_NOTE = (
    "TorchSnapshot's S3 plugin takes no endpoint (it ignores storage_options); it reaches "
    "the server only through botocore's AWS_ENDPOINT_URL_S3 environment variable"
)


class S3System:
    name = ""
    label = ""

    def __init__(self, obj: ObjectStore) -> None:
        self.obj = obj

    def setup(self) -> None:
        """Raise ``ckbench.systems.Unavailable`` when the system cannot run here."""

    def prepare(self, prefix: str) -> None:
        """Untimed setup before the first save below ``prefix``."""

    def save(self, state: dict[str, Any], prefix: str, i: int) -> Any:
        raise NotImplementedError

    def restore(self, h: Any, dest: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Ckstore(S3System):
    name, label = "ckstore", "ckstore"

    def setup(self) -> None:
        import ckstore

        self.ck = ckstore
        self.tmp = tempfile.TemporaryDirectory(prefix="ckbench-index-")
        self.stores: dict[str, Any] = {}

    def open(self, prefix: str) -> Any:
        if prefix not in self.stores:
            index = f"sqlite:///{Path(self.tmp.name) / (prefix.replace('/', '_') + '.db')}"
            self.stores[prefix] = self.ck.open(
                self.obj.url(f"{prefix}/store"),
                index=index,
                storage_options=self.obj.storage_options(),
                create=True,
            )
        return self.stores[prefix]

    def prepare(self, prefix: str) -> None:
        self.open(prefix)

    def save(self, state: dict[str, Any], prefix: str, i: int) -> Any:
        app = {k: self.ck.StateDict(v) for k, v in state.items()}
        self.open(prefix).take(app, run="bench", step=i)
        return (prefix, f"bench@{i}")

    def restore(self, h: Any, dest: dict[str, Any]) -> None:
        prefix, ref = h
        self.open(prefix).get(ref).restore({k: self.ck.StateDict(v) for k, v in dest.items()})

    def close(self) -> None:
        for s in self.stores.values():
            s.close()
        self.stores.clear()
        self.tmp.cleanup()


class Dcp(S3System):
    name, label = "dcp", "DCP (fsspec)"

    def __init__(self, obj: ObjectStore, threads: int) -> None:
        super().__init__(obj)
        self.threads = threads

    def setup(self) -> None:
        import s3fs  # noqa: F401 - FsspecWriter needs it for s3:// URLs
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        self.dcp, self.writer, self.reader = dcp, FsspecWriter, FsspecReader

    def save(self, state: dict[str, Any], prefix: str, i: int) -> Any:
        url = self.obj.url(f"{prefix}/ckpt{i}")
        w = self.writer(url, thread_count=self.threads, **self.obj.storage_options())
        self.dcp.save(state, storage_writer=w)
        return url

    def restore(self, h: Any, dest: dict[str, Any]) -> None:
        self.dcp.load(dest, storage_reader=self.reader(h, **self.obj.storage_options()))


class TorchSnapshot(TorchSnapshotApp, S3System):
    name, label = "torchsnapshot", "TorchSnapshot"

    def save(self, state: dict[str, Any], prefix: str, i: int) -> Any:
        url = self.obj.url(f"{prefix}/snap{i}")
        with self.obj.botocore_env():
            self.ts.Snapshot.take(path=url, app_state=self.app(state))
        return url

    def restore(self, h: Any, dest: dict[str, Any]) -> None:
        app = self.app(dest)
        with self.obj.botocore_env():
            self.ts.Snapshot(h).restore(app)
        for k in dest:  # StateDict(**v) copies the top level: hand back the non-tensor values
            for kk, v in app[k].items():
                if not isinstance(dest[k].get(kk), torch.Tensor):
                    dest[k][kk] = v


def make(name: str, obj: ObjectStore, dcp_threads: int) -> S3System:
    if name == "dcp":
        return Dcp(obj, dcp_threads)
    return {"ckstore": Ckstore, "torchsnapshot": TorchSnapshot}[name](obj)
