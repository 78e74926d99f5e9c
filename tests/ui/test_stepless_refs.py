"""A snapshot taken without a step is shown as ``run (0123456789ab)``, a ref the server
resolves: picked as A or B, it compares. Before, the page showed ``run 0123456789ab``, which
no ref resolver understands, and comparing it failed with "no snapshot matches"."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlencode

import torch

import ckstore
from ckstore.ui.timeline import ref_of
from tests.ui.browser import serve
from tests.ui.test_security import request


def test_a_snapshot_without_a_step_is_shown_as_a_ref_that_compares(tmp_path: Path) -> None:
    with ckstore.open(tmp_path / "s", create=True) as store:
        for value in (1.0, 2.0):
            store.take({"m": ckstore.StateDict({"w": torch.full((4,), value)})}, run="adhoc")
        a, b = (ref_of(s.record) for s in store.log(run="adhoc"))
    assert a.startswith("adhoc (") and b.startswith("adhoc (")
    s = serve(str(tmp_path / "s"))
    try:
        status, _, out = request(s, "GET", "/api/diff?" + urlencode({"a": a, "b": b}))
    finally:
        s.stop()
    assert status == 200, out
    assert json.loads(out)["a"]["id"] != json.loads(out)["b"]["id"]
