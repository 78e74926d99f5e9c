"""One store-level suite on local+SQLite, memory+SQLite and S3 (moto) + PostgreSQL."""

from __future__ import annotations

import torch

import ckstore
from tests.support.states import bits, dtype_matrix


def test_take_restore_dedup_read_check_gc(any_store):
    store = any_store
    state = dtype_matrix(3)
    model = torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 40)).sum().backward()
    opt.step()
    app = {"t": ckstore.StateDict(state), "model": model, "optim": opt}
    first = store.take(app, run="r", step=1, tags=["first"], metadata={"loss": 0.5})
    second = store.take(app, run="r", step=2)
    assert (
        second.stats["new_chunks"] == 0
        and second.stats["reused_chunks"] == first.stats["new_chunks"]
    )
    assert [s.step for s in store.log("r")] == [2, 1] and store.get("first").id == first.id
    assert store.get("r@1").metadata == {"loss": 0.5}

    dest = {
        "t": ckstore.StateDict(),
        "model": torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 8)),
        "optim": None,
    }
    dest["optim"] = torch.optim.Adam(dest["model"].parameters())
    store.get("r").restore(dest)
    assert all(bits(dest["t"][k]) == bits(v) for k, v in state.items())
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), dest["model"].state_dict().values())
    )
    assert bits(store.get("r@1").read_object("model/0.weight")) == bits(model[0].weight)

    assert store.check(read_data=True).ok
    store.delete("r@2")
    report = store.gc(grace_seconds=0)
    assert report.chunks_removed == 0  # r@1 still needs everything
    store.untag("first")
    store.delete("r@1")
    report = store.gc(grace_seconds=0)
    assert report.chunks_removed == first.stats["new_chunks"] and report.packs_removed > 0
    assert store.repository.objects.list_packs() == [] and store.check(read_data=True).ok
