"""The helper process's side of ``offload.py``: take each job the training process sends,
from its copies in shared memory, and reply (``python -m ckstore.engine.take.offload_server
FD``, FD a Unix socket to the training process)."""

from __future__ import annotations

import mmap
import os
import pickle
import socket
import sys
import warnings
from functools import partial
from types import MappingProxyType
from typing import Any

import torch

from ...errors import StorageError
from ...format.tree import unflatten
from ..opening import open_repository
from ..repository import Repository
from .offload import Staged, receive, send
from .single import take
from .spec import TakeSpec


def serve(fd: int) -> None:
    """The helper's loop: take each job, reply, until the training process hangs up."""
    try:
        os.nice(19)  # every thread it starts inherits the lowest priority
    except OSError:
        pass
    torch.set_num_threads(1)
    sock = socket.socket(fileno=fd)
    repo: Repository | None = None
    opened: dict[str, Any] | None = None
    while True:
        try:
            message, fds = receive(sock)
        except (EOFError, OSError):
            break
        try:
            if repo is None or message["open"] != opened:
                if repo is not None:
                    repo.close()
                repo, opened = _open(message["open"]), message["open"]
            reply = _take(repo, message, fds[0])
        except BaseException as exc:  # noqa: BLE001 - sent to the training process
            reply = {"error": _portable(exc)}
        finally:
            for f in fds:
                os.close(f)
        try:
            send(sock, reply)
        except OSError:
            break
    if repo is not None:
        repo.close()


def _open(how: dict[str, Any]) -> Repository:
    return open_repository(
        how["url"], index=how.get("index"), storage_options=how.get("storage_options")
    )


def _take(repo: Repository, message: dict[str, Any], fd: int) -> dict[str, Any]:
    for knob, value in message["knobs"].items():
        setattr(repo, knob, value)
    spec_fields = message["spec"]
    spec = TakeSpec(**{**spec_fields, "metadata": MappingProxyType(spec_fields["metadata"])})
    mem = mmap.mmap(fd, message["size"], flags=mmap.MAP_SHARED)
    states = {
        name: unflatten(tree, partial(_leaf, leaves, mem))
        for name, (tree, leaves) in message["apps"].items()
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = take(repo, states, spec)
    del states
    return {
        "record": result.record,
        "manifest": result.manifest.to_json(),
        "warnings": [(type(w.message).__name__, str(w.message)) for w in caught],
    }


def _leaf(leaves: dict[str, Any], mem: Any, key: str) -> Any:
    value = leaves[key]
    return value.view(mem) if isinstance(value, Staged) else value


def _portable(exc: BaseException) -> BaseException:
    """``exc``, or a StorageError with its text where it does not survive pickling."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure: send its text instead
        return StorageError(f"{type(exc).__name__}: {exc}")
    return exc


if __name__ == "__main__":  # run as a module: imports what the jobs were pickled against
    from ckstore.engine.take import offload_server

    offload_server.serve(int(sys.argv[1]))
