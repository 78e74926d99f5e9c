"""How fast ``ckstore ui`` paints a store of 10,000 snapshots, and compares two of 1,000 tensors.

    python bench/ui_bench.py [--snapshots 10000] [--tensors 1000] [--runs 20] [--rounds 5]

The store is built in a temporary folder in two parts:

- two real snapshots (``real@0``, ``real@1``) of ``--tensors`` float32 tensors of 32 x 32,
  taken through ``Store.take``; half the tensors change between them. These are what the
  compare reads (manifests, chunks, the numeric diff);
- ``--snapshots`` more snapshot rows (``--runs`` runs, a tag every 100th) written straight
  into the index tables in one transaction (``ckstore.index.models``), each pointing at one of
  the two real manifests, so every snapshot lists 1,000 tensors. That takes seconds where
  10,000 takes would take an hour here. They carry no chunk references: 10 million reference
  rows would be gigabytes on this machine, and the first paint reads snapshot rows and tags
  only (the references matter to fork edges, sharing and gc, which are not timed here).

Then ``ckstore ui`` runs in its own process and headless Chromium (Debian's) loads the page:
**first paint** is navigation start to the lineage drawn (the page's ``ckstore-first-paint``
mark, set in the frame after the graph is drawn); **compare** is the click on Compare to the
heat map drawn, index-only and numeric, in the browser, plus the JSON API alone. Timings
belong here, not in the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.ui.browser drives Chromium


def build(path: Path, snapshots: int, tensors: int, runs: int) -> None:
    import torch
    from sqlalchemy import insert

    import ckstore
    from ckstore.index import models

    torch.manual_seed(0)
    state = {
        f"layers.{i // 4}.{('q', 'k', 'v', 'o')[i % 4]}.weight": torch.randn(32, 32)
        for i in range(tensors)
    }
    with ckstore.open(path, create=True) as store:
        a = store.take({"model": ckstore.StateDict(**state)}, run="real", step=0, tags=["a"])
        for i, key in enumerate(sorted(state)):
            if i % 2:
                state[key] = state[key] + torch.randn(32, 32) * 10.0 ** -(1 + i % 5)
        b = store.take({"model": ckstore.StateDict(**state)}, run="real", step=1, tags=["b"])
        manifests = [a.record, b.record]
        start = time.time() - 30 * 86400
        rows, tags, run_rows = [], [], []
        per_run = max(1, snapshots // runs)
        for r in range(runs):
            name = f"run-{r:02d}"
            run_rows.append({"name": name, "created_at": start})
            parent = None
            for k in range(per_run):
                n = r * per_run + k
                m = manifests[n % 2]
                sid = f"{n:064x}"
                rows.append({
                    "id": sid, "run": name, "seq": k + 1, "step": 100 * k, "parent_id": parent,
                    "manifest_id": m.manifest_id, "created_at": start + n * 30 * 86400 / snapshots,
                    "metadata": json.dumps({"loss": 2.0 / (1 + k)}), "logical_bytes": m.logical_bytes,
                    "new_bytes": m.logical_bytes // (10 if k else 1), "new_chunks": tensors // 10,
                    "reused_chunks": tensors - tensors // 10, "name": None, "world_size": 1,
                })  # fmt: skip
                if k % 100 == 99:
                    tags.append(
                        {
                            "name": f"{name}-best-{k}",
                            "snapshot_id": sid,
                            "version": 1,
                            "updated_at": start,
                        }
                    )
                parent = sid
        with (
            store.repository.index._engine.begin() as conn
        ):  # straight into the tables: see the docstring
            conn.execute(insert(models.runs), run_rows)
            conn.execute(insert(models.snapshots), rows)
            conn.execute(insert(models.tags), tags)


def serve(path: Path) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "CKSTORE_UI_TOKEN": "bench"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckstore.cli", "--store", str(path), "ui", "--port", "0", "--no-open"],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.readline()
    url = proc.stdout.readline().split("open ", 1)[1].strip()
    return proc, url.split("/?")[0]


def api_time(url: str) -> float:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as r:
        r.read()
    return time.perf_counter() - start


def first_paints(browser: Any, base: str, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        time.sleep(2.1)  # past the server's 2 s history cache: each load lists the snapshots
        page = browser.page()
        page.goto(base + "/?token=bench")
        page.wait_for_selector("html[data-ready='1']", timeout=60_000)
        out.append(
            page.evaluate("performance.getEntriesByName('ckstore-first-paint')[0].startTime")
        )
        points = page.locator("#lineage-canvas").get_attribute("data-points")
        page.close()
    print(f"  lineage drew {points} snapshots")
    return out


def compares(browser: Any, base: str, numeric: bool, rounds: int) -> list[float]:
    page = browser.page()
    page.goto(base + "/#changes")
    page.wait_for_selector("html[data-ready='1']", timeout=60_000)
    page.fill("#ref-a", "a")
    page.fill("#ref-b", "b")
    page.set_checked("#numeric", numeric)
    out = []
    for _ in range(rounds):
        start = page.evaluate("performance.now()")
        page.click("#compare-button")
        page.wait_for_selector("#view-changes[data-state='done']", timeout=120_000)
        out.append(
            page.evaluate("performance.getEntriesByName('ckstore-compare-done').pop().startTime")
            - start
        )
        page.evaluate("document.getElementById('view-changes').dataset.state = ''")
    cells = page.locator("#heatmap").get_attribute("data-cells")
    page.close()
    print(f"  heat map drew {cells} tensors ({'numeric' if numeric else 'index only'})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--snapshots", type=int, default=10_000)
    ap.add_argument("--tensors", type=int, default=1_000)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from tests.ui.browser import Browser

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store"
        t = time.perf_counter()
        build(path, args.snapshots, args.tensors, args.runs)
        print(
            f"built {args.snapshots} snapshot rows + 2 takes of {args.tensors} tensors in {time.perf_counter() - t:.1f} s"
        )
        proc, base = serve(path)
        browser = Browser()
        try:
            time.sleep(5)  # the server imports torch in the background (for the numeric diff)
            cold = api_time(base + "/api/overview")
            warm = min(api_time(base + "/api/overview") for _ in range(3))
            print(
                f"GET /api/overview: {1000 * cold:.0f} ms listing the index, {1000 * warm:.0f} ms cached"
            )
            fp = first_paints(browser, base, args.rounds)
            print(
                f"first paint: median {statistics.median(fp):.0f} ms, best {min(fp):.0f} ms ({args.rounds} loads)"
            )
            for numeric in (False, True):
                label = "numeric" if numeric else "index only"
                api = [
                    api_time(f"{base}/api/diff?a=a&b=b&numeric={int(numeric)}") for _ in range(3)
                ]
                print(f"GET /api/diff ({label}): best {1000 * min(api):.0f} ms of 3")
                ms = compares(browser, base, numeric, args.rounds)
                print(
                    f"compare in the page ({label}): median {statistics.median(ms):.0f} ms, best {min(ms):.0f} ms"
                )
        finally:
            browser.close()
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
