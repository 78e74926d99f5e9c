"""``restore(cast=True)`` into a model built on the meta device in another float dtype (a bf16
model from an fp32 snapshot) loads the weights, converted, as new tensors. Before, the cast
branch copied into the meta tensors (a no-op) and the meta check never ran: the restore
returned normally with nothing loaded. A parameter the module already holds keeps its
identity (an optimizer built before the restore still sees it)."""

from __future__ import annotations

import pytest
import torch

import ckstore


@pytest.mark.parametrize("atomic", [True, False])
def test_cast_restore_into_a_meta_model_loads_converted_weights(store, atomic):
    torch.manual_seed(0)
    src = torch.nn.Linear(30, 20)  # float32
    store.take({"model": src}, run="r", step=1)

    with torch.device("meta"):
        model = torch.nn.Linear(30, 20).to(torch.bfloat16)
    store.get("r@1").restore({"model": model}, cast=True, atomic=atomic)
    assert model.weight.dtype == torch.bfloat16
    assert not model.weight.is_meta and not model.bias.is_meta, model.weight.device
    assert torch.equal(model.weight.float(), src.weight.detach().bfloat16().float())


@pytest.mark.parametrize("atomic", [True, False])
def test_cast_into_a_partly_meta_module_keeps_its_materialised_parameters(
    store: ckstore.Store, atomic: bool
) -> None:
    torch.manual_seed(0)
    src = torch.nn.Linear(30, 20)  # float32
    store.take({"model": src}, run="r", step=1)
    with torch.device("meta"):
        model = torch.nn.Linear(30, 20).to(torch.bfloat16)
    model.weight = torch.nn.Parameter(torch.zeros(20, 30, dtype=torch.bfloat16))  # materialised
    weight = model.weight
    store.get("r@1").restore({"model": model}, cast=True, atomic=atomic)
    assert not model.bias.is_meta
    assert torch.equal(model.weight.float(), src.weight.detach().bfloat16().float())
    assert model.weight is weight, "the module's materialised parameter was replaced"
