"""A torchtitan-style checkpointer (its listing, purge and load logic, with plain paths), and
what each rank runs in the marked-folder tests (imported in forked children)."""

from __future__ import annotations

import os
import queue
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from tests.support.states import bits


class TitanApp:
    """model + optimizer + a step counter, as torchtitan's training state (trained once, so
    the optimizer has its moments and a load fills them); its step after that first training
    step is ``first_step``."""

    def __init__(self, seed: int = 0, first_step: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.step = first_step - 1
        self.train()

    def train(self) -> None:
        loss = self.model(torch.randn(16, 64)).square().mean()
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        self.step += 1

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": self.optim.state_dict(),
            "train_state": {"step": self.step},
        }

    def put(self, state: dict[str, Any]) -> None:
        """Take back a ``state()`` that a load filled."""
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])
        self.step = int(state["train_state"]["step"])

    def same_as(self, other: TitanApp) -> bool:
        a, b = self.model.state_dict(), other.model.state_dict()
        oa, ob = self.optim.state_dict()["state"], other.optim.state_dict()["state"]
        moments = all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i])
        return all(torch.equal(a[k], b[k]) for k in a) and moments and self.step == other.step


class TitanCheckpointer:
    """torchtitan's CheckpointManager reduced to its file-system use: ``dcp.save`` /
    ``dcp.async_save`` / ``dcp.load`` with ``os.path.join(folder, f"step-{n}")``, the resume
    step from ``os.listdir`` + ``isfile(.metadata)``, and ``keep_latest_k`` purged by
    ``shutil.rmtree`` in a thread. Nothing here knows of ckstore. ``filter_names=False`` is
    the purge of torchtitan's releases before it filtered names: ``match.group(1)`` of every
    name in the folder."""

    def __init__(self, folder: str, keep_latest_k: int = 0, filter_names: bool = True) -> None:
        self.folder = folder
        self.keep_latest_k = keep_latest_k
        self.filter_names = filter_names
        self.purge_queue: queue.Queue[str | None] = queue.Queue()
        self.purge_thread = threading.Thread(target=self._purge_loop, daemon=True)
        self.purge_thread.start()

    def _create_checkpoint_id(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def save(self, step: int, state: dict[str, Any], use_async: bool = False) -> None:
        if use_async:
            dcp.async_save(state, checkpoint_id=self._create_checkpoint_id(step)).result()
        else:
            dcp.save(state, checkpoint_id=self._create_checkpoint_id(step))

    def find_load_step(self) -> int:
        step_counts = []
        if not os.path.isdir(self.folder):
            return -1
        for filename in os.listdir(self.folder):
            match = re.search(r"step-(\d+)", filename)
            metadata_probe = os.path.join(self.folder, filename, ".metadata")
            if match and os.path.isfile(metadata_probe):
                step_counts.append(int(match.group(1)))
        return max(step_counts) if step_counts else -1

    def listed(self) -> list[int]:
        found = []
        for filename in os.listdir(self.folder):
            match = re.search(r"step-(\d+)", filename)
            if match and os.path.isfile(os.path.join(self.folder, filename, ".metadata")):
                found.append(int(match.group(1)))
        return sorted(found)

    def purge_stale_checkpoints(self) -> None:
        if self.keep_latest_k > 0 and os.path.isdir(self.folder):
            discovered = []
            for filename in os.listdir(self.folder):
                match = re.search(r"step-(\d+)", filename)
                if match or not self.filter_names:
                    assert match is not None, f"{filename} crashes this purge (no step)"
                    discovered.append((int(match.group(1)), os.path.join(self.folder, filename)))
            discovered.sort()
            for _, path in discovered[: -1 * self.keep_latest_k]:
                self.purge_queue.put(path)
        self.purge_queue.join()  # the test waits for the thread, as the next save would not

    def _purge_loop(self) -> None:
        while True:
            path = self.purge_queue.get()
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
            self.purge_queue.task_done()

    def load(self, step: int, state: dict[str, Any]) -> None:
        dcp.load(state, checkpoint_id=self._create_checkpoint_id(step))


def _state(world: int, step: int, zeros: bool) -> dict[str, Any]:
    from tests.dcp import scenarios as ds

    state = ds.sharded(world, "shard0", zeros)
    for v in state.values():  # every step's state differs: the step added to every value
        if not zeros:
            (v if type(v) is torch.Tensor else v.to_local()).add_(step)
    state["train_state"] = {"step": 0 if zeros else step}
    return state


def titan_ranks(rank: int, world: int, folder: str, store_url: str) -> dict[str, Any]:
    """Every rank saves steps 1..5 into the marked folder; rank 0 purges to 2 after each
    save (then all meet), and reports which steps the store held after each save; at the end
    every rank resumes the newest step into zeros, checked bit-exact."""
    import torch.distributed as dist

    import ckstore

    ckpt = TitanCheckpointer(folder, keep_latest_k=2 if rank == 0 else 0)
    held: list[list[int]] = []
    listed: list[list[int]] = []
    for step in range(1, 6):
        ckpt.save(step, _state(world, step, zeros=False))
        if rank == 0:
            listed.append(ckpt.listed())
            with ckstore.open(store_url) as store:
                held.append(sorted(s.step for s in store.log("titan")))
            ckpt.purge_stale_checkpoints()
        dist.barrier()
    step = ckpt.find_load_step()
    state = _state(world, 0, zeros=True)
    ckpt.load(step, state)
    expected = _state(world, step, zeros=False)
    for k, v in expected.items():
        got = state[k]
        if k == "train_state":
            assert got == v, (got, v)
        else:
            a = got if type(got) is torch.Tensor else got.to_local()
            b = v if type(v) is torch.Tensor else v.to_local()
            assert bits(a) == bits(b), k  # bit-exact (the states hold NaN payloads)
    return {"step": step, "held": held, "listed": listed}


def marked_titan(root: Path) -> tuple[str, str]:
    """A store (tiny knobs) and a folder marked for it, run ``titan``, with step 1 saved in it
    (:func:`step_state`); the store's URL and the folder."""
    import ckstore
    from ckstore.dcp import mark_folder

    url = str(root / "store")
    ckstore.open(url, chunk_bytes=1024, pack_bytes=8192, create=True).close()
    folder = str(root / "ckpt")
    mark_folder(folder, url, run="titan")
    dcp.save(step_state(1), checkpoint_id=os.path.join(folder, "step-1"))
    return url, folder


def step_state(step: int) -> dict[str, torch.Tensor]:
    """A 16 KiB state that is a function of ``step``."""
    return {"w": torch.randn(4096, generator=torch.Generator().manual_seed(step))}
