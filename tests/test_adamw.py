"""The stock ``adamw`` optimizer's arithmetic: the floor under ``v`` that keeps ATen's CPU ``sqrt`` off its slow
path on zeros and subnormals changes no update, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from ipuft.optim import StepContext
from ipuft_optim_adam.adamw import SMALLEST_NORMAL, AdamW


def _second_moments(n: int) -> torch.Tensor:
    """``v`` as an embedding's looks: mostly exact zeros (rows no token touched), subnormals (a row's last
    gradient long ago, decayed by β2), values next to the smallest normal float32, and ordinary ones."""
    g = torch.Generator().manual_seed(0)
    v = torch.rand(n, generator=g) * 1e-6
    v[: n // 2] = 0.0
    v[n // 2 : n // 2 + 64] = torch.logspace(-45, -38, 64)  # subnormals up to just under 2^-126
    edge = torch.tensor([SMALLEST_NORMAL]).view(torch.int32).item()
    v[n // 2 + 64 : n // 2 + 72] = torch.arange(edge - 4, edge + 4, dtype=torch.int32).view(torch.float32)
    return v


def _update(opt: AdamW, step: int, fused: bool, n: int = 4096) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g) * 1e-3
    grad[: n // 2 + 72] = 0.0  # no gradient this step where v is 0 or tiny
    m = torch.randn(n, generator=g) * 1e-8  # momentum: the update divides it by the denominator
    state = {"m": m, "v": _second_moments(n)}
    ctx = StepContext(lr=1e-2, step=step, global_norm=1.0, grad_factor=1.0)
    if fused:
        opt.step_unit(["layer.weight"], [weight], [grad], [state], ctx)
    else:
        opt.step("layer.weight", weight, grad, state, ctx)
    return weight, state["m"], state["v"]


def _bits(tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [t.view(torch.int32) for t in tensors]


@pytest.mark.parametrize("fused", [True, False], ids=["step_unit", "step"])
@pytest.mark.parametrize("eps,beta2", [(1e-6, 0.999), (1e-8, 0.999), (1e-8, 0.9999), (1e-3, 0.95)])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_the_floor_under_v_changes_no_update(monkeypatch, fused, eps, beta2, step):
    opt = AdamW(0.9, beta2, eps, weight_decay=0.1)
    assert opt.sqrt_floor(1.0 - beta2**step) == SMALLEST_NORMAL  # these settings take the fast path
    floored = _update(opt, step, fused)
    monkeypatch.setattr(opt, "sqrt_floor", lambda bias2: None)
    plain = _update(opt, step, fused)
    for a, b in zip(_bits(floored), _bits(plain), strict=True):
        assert torch.equal(a, b)


def test_a_floor_that_would_change_updates_is_not_taken(monkeypatch):
    """With an ``eps`` so small that ``√(2^-126) / √bias2`` is not lost in it, there is no floor; and a floor
    past the bound does change updates (what the first test would catch)."""
    tiny = AdamW(0.9, 0.999, 1e-30, weight_decay=0.0)
    assert tiny.sqrt_floor(1.0 - 0.999) is None
    opt = AdamW(0.9, 0.999, 1e-8, weight_decay=0.0)
    assert opt.sqrt_floor(1.0 - 0.999) is not None
    plain = _update(tiny, 1, True)
    monkeypatch.setattr(tiny, "sqrt_floor", lambda bias2: SMALLEST_NORMAL)
    assert not torch.equal(_update(tiny, 1, True)[0], plain[0])
    monkeypatch.setattr(opt, "sqrt_floor", lambda bias2: 2.0**-40)
    wrong = _update(opt, 1, True)
    monkeypatch.setattr(opt, "sqrt_floor", lambda bias2: None)
    assert not torch.equal(wrong[0], _update(opt, 1, True)[0])


def test_the_bound_is_where_the_denominator_stops_being_eps():
    """The bound ``eps·√bias2 ≥ 2^-37`` is conservative but not loose by more than the factors it names: just
    inside it ``2^-63 / √bias2 + eps`` rounds to ``eps``, and where ``eps·√bias2`` is 2^-10 of it, not."""
    for eps in (1e-6, 3e-8, 1e-10):
        c = 2.0**-37 / eps  # √bias2 on the bound
        denom = torch.tensor([2.0**-63], dtype=torch.float32).div_(c).add_(eps)
        assert denom.item() == torch.tensor(eps, dtype=torch.float32).item()
        denom = torch.tensor([2.0**-63], dtype=torch.float32).div_(c * 2.0**-10).add_(eps)
        assert denom.item() != torch.tensor(eps, dtype=torch.float32).item()
    assert math.sqrt(SMALLEST_NORMAL) == 2.0**-63
