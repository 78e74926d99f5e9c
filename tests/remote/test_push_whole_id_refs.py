"""push/pull refs: a snapshot's whole id names that snapshot first, as ``store.get`` does
(index/_resolve.py rule 0), whatever tag or run is spelt like it."""

from __future__ import annotations

import ckstore


def test_a_tag_spelt_like_a_whole_id_does_not_redirect_a_push(source, tmp_path) -> None:
    clicked, precious = source.get("r@1").id, source.get("s").id
    source.tag(precious, clicked)  # a tag spelt like r@1's whole id (pulled from a remote, say)
    assert source.get(clicked).id == clicked
    source.add_remote("origin", tmp_path / "remote")
    source.push("origin", [clicked])
    with ckstore.open(tmp_path / "remote") as remote:
        sent = {s.id for s in remote.log(run=None)}
    assert sent == {clicked}, "pushed the tagged snapshot, not the one the whole id names"


def test_a_run_spelt_like_a_whole_id_does_not_redirect_a_push(source, tmp_path) -> None:
    clicked = source.get("r@2").id
    source.take({"m": ckstore.StateDict({"x": 1})}, run=clicked, step=1)  # a run spelt like it
    source.add_remote("origin", tmp_path / "remote")
    source.push("origin", [clicked])
    with ckstore.open(tmp_path / "remote") as remote:
        sent = {s.id for s in remote.log(run=None)}
    assert sent == {clicked}, "pushed the run spelt like the id, not the snapshot"
