"""Reading a subtree keeps every leaf's own type (pruning walks only the tree's containers)."""

from __future__ import annotations

from pathlib import Path

import torch

import ckstore
from ckstore.format.tree import ABSENT, prune


def test_prune_keeps_a_torch_size_leaf() -> None:
    got = prune({"s": torch.Size([2, 3]), "gone": ABSENT, "l": [1, ABSENT, (2, ABSENT)]})
    assert type(got["s"]) is torch.Size and got == {"s": torch.Size([2, 3]), "l": [1, (2,)]}


def test_read_object_of_a_torch_size_is_a_torch_size(tmp_path: Path) -> None:
    store = ckstore.open(tmp_path / "s", create=True)
    state = ckstore.StateDict(
        size=torch.Size([2, 3]), nested={"shape": torch.Size([4])}, w=torch.ones(3)
    )
    snap = store.take({"app": state}, run="r", step=1)
    assert type(snap.read_object("app/size")) is torch.Size
    whole = snap.read_object("app")
    assert type(whole["size"]) is torch.Size and type(whole["nested"]["shape"]) is torch.Size
    assert type(snap.get_state_dict_for_key("app")["size"]) is torch.Size
    assert type(ckstore.Snapshot.of(snap).read_object("0/app/size")) is torch.Size
    store.close()
