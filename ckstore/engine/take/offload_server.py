"""The helper process's side of ``offload.py``: take each job the training process sends,
from its copies in shared memory, and reply (``python -m ckstore.engine.take.offload_server
FD``, FD a Unix socket to the training process; the loop is ``engine/helper.py``'s)."""

from __future__ import annotations

import mmap
import sys
import warnings
from functools import partial
from types import MappingProxyType
from typing import Any

import torch

from ...format.tree import unflatten
from .. import helper
from ..repository import Repository
from .offload import Staged
from .single import take
from .spec import TakeSpec


def serve(fd: int) -> None:
    """The helper's loop: take each job, reply, until the training process hangs up."""
    torch.set_num_threads(1)
    helper.serve(fd, _take)


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


if __name__ == "__main__":  # run as a module: imports what the jobs were pickled against
    from ckstore.engine.take import offload_server

    offload_server.serve(int(sys.argv[1]))
