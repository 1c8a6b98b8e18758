"""The compiled one-pass update (``ipuft.engine.compiled``, the device's): compiled here by Inductor's CPU backend,
element for element the torch ops' update bit for bit for each recipe it takes (float32; bfloat16 and float16
rounded stochastically), whatever the pieces; the pieces it leaves to the ops; run by the engine in the C kernel's
place; and a compiler that fails leaves the ops' update, told so in one line. On CUDA the same comparison is
``bench/gpu.py``'s."""

from __future__ import annotations

import itertools

import pytest
import test_fused_update
import torch
from test_engine import EQUIVALENCE, make_engine, run_engine
from test_fused_update import (
    KEY,
    N,
    assert_same_bits,
    bits,
    case,
    check_8bit_update,
    ops_update,
    test_the_8bit_kernel_keeps_the_ops_codes_of_a_non_finite_block,
)

from ipuft.engine import compiled, fused
from ipuft.optim import StepContext
from ipuft_optim_adam.adamw import AdamW
from ipuft_optim_adamw8bit import compiled as compiled8

RECIPES = [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, True)]
RECIPE_IDS = ["float32", "bf16-sr", "bf16-sr-bf16-grad", "fp16-sr-fp16-grad"]


def compiled_update(opt: AdamW, name: str, t: dict[str, torch.Tensor], ctx: StepContext, first: int,
                    cuts: tuple[int, ...] = ()) -> None:
    """The compiled update of ``t`` in pieces cut at ``cuts``, each with its own first counter."""
    edges = (0, *cuts, t["w"].numel())
    for a, b in itertools.pairwise(edges):
        piece = {k: x[a:b] for k, x in t.items()}
        rounding = None if t["w"].dtype == torch.float32 else (KEY, first + a)
        assert compiled.serves(piece["w"], piece["g"], rounding)
        compiled.adamw_(piece["w"], piece["g"], piece["m"], piece["v"], opt.scalars(name, ctx, ctx.grad_factor),
                        rounding)


@pytest.mark.parametrize(("dtype", "grad16"), RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize(("name", "eps", "step"), [("h.0.mlp.weight", 1e-6, 1), ("h.0.ln.bias", 1e-6, 9),
                                                   ("h.0.attn.weight", 1e-30, 3)],
                         ids=["decay-floor", "no-decay", "no-floor"])
def test_the_compiled_update_is_the_ops_bit_for_bit(dtype, grad16, name, eps, step):
    """Weight, moments: the same bits, with the factor, the floor under ``v`` (or none), decay or the no-decay
    rule, a float32 or 16-bit gradient, float16's subnormals and largest values; in three pieces (one compiled
    kernel for every length)."""
    opt = AdamW(0.9, 0.999, eps, weight_decay=0.1)
    ctx = StepContext(lr=3e-3, step=step, global_norm=4.0, grad_factor=0.37 / 64)
    start = case(dtype, grad16=grad16)
    ops = {k: t.clone() for k, t in start.items()}
    ops_update(opt, name, ops, ctx, 1000)
    got = {k: t.clone() for k, t in start.items()}
    compiled_update(opt, name, got, ctx, 1000, cuts=(N // 3, N // 3 + 2))
    assert_same_bits(got, ops)
    assert torch.equal(got["g"], start["g"])  # the gradient as it was
    assert not torch.equal(got["w"], start["w"])


@pytest.mark.parametrize("first", [0, (1 << 31) - N], ids=["zero", "last-under-2^31"])
def test_bfloat16_edges_round_as_the_ops(first):
    """bfloat16 next to its largest finite value, infinities, zeros of both signs, and counters up to 2^31:
    the ops' bits (NaN aside: its bits are the compiler's)."""
    opt = AdamW(0.9, 0.999, 1e-6, weight_decay=0.0)
    ctx = StepContext(lr=1e-3, step=2, global_norm=1.0, grad_factor=0.5)
    start = case(torch.bfloat16)
    largest = torch.tensor(3.3895e38)
    start["w"][:40] = torch.linspace(-1.0, 1.0, 40) * largest
    start["w"][40:44] = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0])
    ops = {k: t.clone() for k, t in start.items()}
    ops_update(opt, "w", ops, ctx, first)
    got = {k: t.clone() for k, t in start.items()}
    compiled_update(opt, "w", got, ctx, first)
    assert_same_bits(got, ops)


@pytest.mark.parametrize(("dtype", "grad_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)],
                         ids=["float32", "bf16-sr"])
def test_the_8bit_update_is_the_ops_bit_for_bit(monkeypatch, dtype, grad_dtype):
    """``adamw8bit``'s compiled update (``ipuft_optim_adamw8bit.compiled``): codes, absmax and weights as
    dequantize → ``adamw``'s ops → quantize over three steps, in pieces on block boundaries, a short last block
    included (the C kernel's test, routed to the compiled kernel); and a block whose moments are not finite."""
    monkeypatch.setenv("IPUFT_COMPILED_UPDATE", "cpu")
    calls = []
    update = compiled8.adamw8bit_
    monkeypatch.setattr(compiled8, "adamw8bit_", lambda *a, **k: calls.append(1) or update(*a, **k))
    check_8bit_update(dtype, grad_dtype, 64)
    assert len(calls) == 9  # three pieces, three steps
    if dtype == torch.float32:  # the same bits, but a NaN's, which are the compiler's
        monkeypatch.setattr(test_fused_update, "assert_same_bits", same_bits_but_nans)
        for bad in (float("inf"), float("nan")):
            test_the_8bit_kernel_keeps_the_ops_codes_of_a_non_finite_block(bad)


def same_bits_but_nans(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for k in a:
        x, y = a[k], b[k]
        if x.is_floating_point():
            nan = x.isnan()
            assert torch.equal(nan, y.isnan()), k
            x, y = x[~nan], y[~nan]
        assert torch.equal(bits(x), bits(y)), k


def test_the_pieces_it_leaves_to_the_ops():
    """Counters given one by one, or past 2^31; a weight or gradient not contiguous or not float; a float32
    weight given a rounding, a 16-bit one none; a single element."""
    w, g = torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8)
    assert compiled.serves(w, g, (KEY, 0))
    assert not compiled.serves(w, g, (KEY, torch.arange(8)))
    assert not compiled.serves(w, g, (KEY, (1 << 31) - 7))
    assert not compiled.serves(w, g, None)
    assert not compiled.serves(torch.zeros(8), g, (KEY, 0))
    assert not compiled.serves(torch.zeros(16, dtype=torch.bfloat16)[::2], g, (KEY, 0))
    assert not compiled.serves(w, torch.zeros(8, dtype=torch.float64), (KEY, 0))
    assert not compiled.serves(torch.zeros(1), torch.zeros(1), None)
    assert compiled.serves(torch.zeros(8), g, None)


def test_cuda_routes_to_it_and_the_cpu_only_when_asked(monkeypatch):
    monkeypatch.delenv("IPUFT_COMPILED_UPDATE", raising=False)
    assert compiled.routes(torch.device("cuda", 0))
    assert not compiled.routes(torch.device("cpu"))
    assert not compiled.routes(torch.device("meta"))
    monkeypatch.setenv("IPUFT_COMPILED_UPDATE", "cpu")
    assert compiled.routes(torch.device("cpu"))
    monkeypatch.setenv("IPUFT_COMPILED_UPDATE", "0")
    assert not compiled.routes(torch.device("cuda", 0))
    assert not fused.serves(torch.zeros(8, device="meta"), torch.zeros(8, device="meta"), None)


def test_a_compiler_that_fails_leaves_the_ops_and_one_line_says_so(monkeypatch, capsys):
    """The piece at hand is updated by the same ops uncompiled; from then on nothing routes to the compiler."""
    def fails(*args, **kwargs):
        raise RuntimeError("backend compiler failed\nwith a long story")

    monkeypatch.setattr(compiled, "_state", {})
    monkeypatch.setattr(compiled, "ADAMW", compiled.Exact(compiled._adamw))
    monkeypatch.setattr(torch, "compile", fails)
    monkeypatch.setenv("IPUFT_COMPILED_UPDATE", "cpu")
    opt = AdamW(0.9, 0.999, 1e-6, weight_decay=0.1)
    ctx = StepContext(lr=3e-3, step=1, global_norm=1.0, grad_factor=1.0)
    start = case(torch.float32)
    got, want = ({k: t.clone() for k, t in start.items()} for _ in range(2))
    for _ in range(2):
        compiled.adamw_(got["w"], got["g"], got["m"], got["v"], opt.scalars("w", ctx))
    h = torch.tensor([getattr(opt.scalars("w", ctx), f) for f in fused._HYPER])
    for _ in range(2):
        compiled._adamw(want["w"], want["g"], want["m"], want["v"], h, 0, 2, 0)
    assert_same_bits(got, want)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ipuft: the compiled one-pass update is not available on cpu (backend compiler failed); the "
                   "optimizer updates with torch ops instead (the same results, more slowly)"]
    assert not compiled.routes(torch.device("cpu")) and not compiled.routes(torch.device("cuda"))


def counted(monkeypatch) -> list[int]:
    """A list that grows by one at each call of the compiled update."""
    calls: list[int] = []
    adamw_ = compiled.adamw_
    monkeypatch.setattr(compiled, "adamw_", lambda *a, **k: calls.append(1) or adamw_(*a, **k))
    return calls


def assert_same_runs(got: tuple, want: tuple) -> None:
    """Two runs' losses, full weights and optimizer state (``(losses, weights, optim)``), bit for bit."""
    assert got[0] == want[0]
    for a, b in zip(got[1:], want[1:], strict=True):
        for unit, tensors in b.items():
            for name, t in tensors.items():
                assert torch.equal(bits(a[unit][name].cpu()), bits(t.cpu())), f"{unit}.{name}"


@pytest.mark.parametrize("recipe", [(), ("model.precision=bfloat16", "training.stochastic_rounding=true",
                                         "execution.optimizer_placement=host"),
                                    ("training.optimizer.name=adamw8bit",)],
                         ids=["float32", "bf16-sr-host", "adamw8bit"])
def test_the_engine_updates_with_it_as_with_the_c_kernel(hooks, make_config, monkeypatch, recipe):
    """A run whose every update goes through the compiled kernels equals the C kernel's run bit for bit."""
    calls = counted(monkeypatch)
    update8 = compiled8.adamw8bit_
    calls8: list[int] = []
    monkeypatch.setattr(compiled8, "adamw8bit_", lambda *a, **k: calls8.append(1) or update8(*a, **k))
    runs = {}
    for setting in ("cpu", "1"):
        monkeypatch.setenv("IPUFT_COMPILED_UPDATE", setting)
        calls.clear()
        calls8.clear()
        common = [o.replace("plugins.adamw.", "plugins.adamw8bit.") if "adamw8bit" in str(recipe) else o
                  for o in EQUIVALENCE]
        cfg = make_config(*common, *recipe)
        engine = make_engine(cfg, hooks)
        runs[setting] = ([r.loss for r in run_engine(engine, cfg)], engine.model.full_weights(),
                         engine.model.full_weights("optim"))
        assert bool(calls) == (setting == "cpu")
        assert bool(calls8) == (setting == "cpu" and "adamw8bit" in str(recipe))
    assert_same_runs(runs["cpu"], runs["1"])
