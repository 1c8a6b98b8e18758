"""The one-pass update kernel (``ipuft.engine.fused``): element for element the torch ops' update bit for bit,
for each recipe (float32; bfloat16 and float16 with stochastic rounding; ``adamw8bit``'s codes), whatever the
pieces; within a few ulps of the update before it (the foreach chain with ``lerp``/``addcmul``/``addcdiv``);
run by the engine; and a machine without a compiler gets the ops, told so in one line."""

from __future__ import annotations

import itertools
import json
import math
import os
import platform
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from test_engine import EQUIVALENCE, make_engine, run_engine

from ipuft.engine import fused
from ipuft.optim import StepContext
from ipuft.precision import stochastic_round_
from ipuft_optim_adam.adamw import AdamW
from ipuft_optim_adamw8bit.adamw8bit import AdamW8bit
from ipuft_optim_adamw8bit.quantize import Codebook

N = 5000  # over a thread's minimum would take longer; the threads' split is tested by THREADED
THREADED = 3 * fused.MIN_THREAD_ELEMENTS + 777
KEY = 0x1234ABCD


def case(dtype: torch.dtype, n: int = N, seed: int = 0, grad16: bool = False) -> dict[str, torch.Tensor]:
    """A piece's weight, gradient and moments as they look mid-run: moments of earlier steps, a quarter of ``v``
    exactly zero (no gradient yet), float16 weights partly subnormal and partly next to its largest value."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.02
    if dtype == torch.float16:
        w[:200] *= 1e-3  # subnormal in float16
        w[200:260] = torch.linspace(65000.0, 65519.0, 60)  # next to the largest finite value
    grad = torch.randn(n, generator=g) * 1e-2
    m = torch.randn(n, generator=g) * 1e-3
    v = torch.rand(n, generator=g) * 1e-5
    v[n // 4 : n // 2] = 0.0
    return {"w": w.to(dtype), "g": grad.to(dtype) if grad16 else grad, "m": m, "v": v}


def ops_update(opt: AdamW, name: str, t: dict[str, torch.Tensor], ctx: StepContext, first: int | torch.Tensor):
    """The update in torch ops, as the engine runs it without the kernel: the factor, ``step_unit`` on a float32
    view, stochastic rounding into a 16-bit weight."""
    grad = t["g"].float() * ctx.grad_factor
    view = t["w"] if t["w"].dtype == torch.float32 else t["w"].float()
    opt.step_unit([name], [view], [grad], [{"m": t["m"], "v": t["v"]}], ctx)
    if view is not t["w"]:
        indices = (lambda a, c: first + a) if isinstance(first, int) else (lambda a, c: first[a : a + c])
        stochastic_round_(t["w"], view, KEY, indices)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[x.element_size()])


def assert_same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for k in a:
        assert torch.equal(bits(a[k]), bits(b[k])), k


needs_kernel = pytest.mark.skipif(fused.library() is None, reason="no C compiler: the kernel is not built")


@pytest.fixture(scope="module")
def avx2_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kernel-without-avx512")


@pytest.fixture(params=["native", "without-avx512"])
def build(request, monkeypatch, avx2_cache) -> str:
    """The kernel as this machine builds it (``-march=native``), and built without AVX-512, so that on an AVX-512
    CPU the tests go through both its vector paths: the byte permutes' decoding and the compiler's gathers there,
    the table reads and the hand-written AVX2 encoding on the rest (on an AVX2 CPU the two builds are the same)."""
    if request.param != "native":
        if platform.machine().lower() not in ("x86_64", "amd64"):
            pytest.skip("-mno-avx512f is an x86-64 compiler's flag")
        monkeypatch.setattr(fused, "FLAGS", [*fused.FLAGS, "-mno-avx512f"])
        monkeypatch.setenv("IPUFT_KERNEL_CACHE", str(avx2_cache))
        monkeypatch.setattr(fused, "_state", {})
        assert fused.library() is not None
    return request.param


def test_the_kernel_builds_where_there_is_a_compiler():
    if shutil.which("cc"):
        assert fused.library() is not None


@needs_kernel
@pytest.mark.parametrize(("dtype", "grad16"), [(torch.float32, False), (torch.bfloat16, False),
                                               (torch.bfloat16, True), (torch.float16, True)],
                         ids=["float32", "bf16-sr", "bf16-sr-bf16-grad", "fp16-sr-fp16-grad"])
@pytest.mark.parametrize(("name", "eps", "step"), [("h.0.mlp.weight", 1e-6, 1), ("h.0.ln.bias", 1e-6, 9),
                                                   ("h.0.attn.weight", 1e-30, 3)],
                         ids=["decay-floor", "no-decay", "no-floor"])
def test_the_kernel_is_the_ops_bit_for_bit(dtype, grad16, name, eps, step):
    """Weight, moments: the same bits, with the factor, the floor under ``v`` (or none: ``eps`` too small for
    it), decay or the no-decay rule, a float32 or 16-bit gradient (the engine keeps 16-bit weights' gradients
    in their dtype); in two pieces at any offset, and over several threads."""
    opt = AdamW(0.9, 0.999, eps, weight_decay=0.1)
    assert (opt.sqrt_floor(1 - 0.999**step) is None) == (eps < 1e-20)
    ctx = StepContext(lr=3e-3, step=step, global_norm=4.0, grad_factor=0.37 / 64)
    for n in (N, THREADED):
        start = case(dtype, n, grad16=grad16)
        ops = {k: t.clone() for k, t in start.items()}
        ops_update(opt, name, ops, ctx, 1000)
        kernel = {k: t.clone() for k, t in start.items()}
        cut = n // 3
        for a, b in ((0, cut), (cut, n)):
            piece = {k: t[a:b] for k, t in kernel.items()}
            rounding = None if dtype == torch.float32 else (KEY, 1000 + a)
            fused.adamw_(piece["w"], piece["g"], piece["m"], piece["v"], opt.scalars(name, ctx, ctx.grad_factor),
                         rounding)
        assert_same_bits(kernel, ops)
        assert torch.equal(kernel["g"], start["g"])  # the kernel leaves the gradient as it was
        assert not torch.equal(kernel["w"], start["w"])


@needs_kernel
@pytest.mark.parametrize("grad16", [False, True], ids=["float32-grad", "bf16-grad"])
@pytest.mark.parametrize("first", [0, (1 << 32) + 7, (1 << 32) - THREADED // 2, (5 << 32) - 3 * N],
                         ids=["low", "above-2^32", "across-2^32", "high"])
def test_bfloat16_consecutive_counters_are_the_ops_bit_for_bit(grad16, first):
    """bfloat16's loop for consecutive counters (each thread's within one span of 2^32, their high half taken
    once) rounds as the ops do, below, above and across 2^32 (a thread whose span crosses it takes the general
    loop), over several threads."""
    opt = AdamW(0.9, 0.999, 1e-6, weight_decay=0.1)
    ctx = StepContext(lr=3e-3, step=2, global_norm=1.0, grad_factor=0.5)
    start = case(torch.bfloat16, THREADED, grad16=grad16)
    ops = {k: t.clone() for k, t in start.items()}
    ops_update(opt, "w", ops, ctx, first)
    kernel = {k: t.clone() for k, t in start.items()}
    fused.adamw_(kernel["w"], kernel["g"], kernel["m"], kernel["v"], opt.scalars("w", ctx, ctx.grad_factor),
                 (KEY, first))
    assert_same_bits(kernel, ops)


@needs_kernel
@pytest.mark.parametrize("grad16", [False, True], ids=["float32-grad", "bf16-grad"])
def test_bfloat16_rounds_its_largest_values_inf_and_nan_as_the_ops_in_any_chunk(grad16, build):
    """The consecutive loop rounds chunks of 64 by the plain stochastic sum and takes the branch to nearest only
    for a chunk holding a value next to bfloat16's largest, an infinity or a NaN: such values at a chunk's start
    and end, alone or several in one chunk, and in the loop's tail (the last thread's range ends 9 elements past a
    chunk), round as the ops do; so do their chunks' ordinary neighbours. A NaN stays NaN with the ops' bits
    (torch's conversion's, which depend on its CPU capability: 0xFFFF with AVX2 and AVX-512, 0x7FC0 without)."""
    opt = AdamW(0.9, 0.999, 1e-6, weight_decay=0.0)
    # a step of about 1e36, bfloat16's largest 3.39e38 a step of 1.3e36: the largest move past it (their float32
    # values between it and infinity, where the plain sum would carry into infinity) or below it
    ctx = StepContext(lr=1e36, step=2, global_norm=1.0, grad_factor=0.5)
    start = case(torch.bfloat16, THREADED, grad16=grad16)
    largest = torch.finfo(torch.bfloat16).max
    specials = {0: largest, 63: -largest, 65: math.inf, 66: -math.inf, 67: math.nan, 4096 + 31: largest * 0.999,
                THREADED - 25: math.nan, THREADED - 9: largest, THREADED - 1: -math.inf}
    for at, value in specials.items():
        start["w"][at] = value
        start["g"][at], start["m"][at] = (-1e-2, -1e-3) if value > 0 else (1e-2, 1e-3)  # a step away from zero
    assert THREADED % 64 == 9
    ops = {k: t.clone() for k, t in start.items()}
    ops_update(opt, "w", ops, ctx, 0)
    kernel = {k: t.clone() for k, t in start.items()}
    fused.adamw_(kernel["w"], kernel["g"], kernel["m"], kernel["v"], opt.scalars("w", ctx, ctx.grad_factor),
                 (KEY, 0))
    assert ops["w"].isnan().nonzero().flatten().tolist() == [67, THREADED - 25]
    assert_same_bits(kernel, ops)
    assert bits(kernel["w"][[0, 65, 66]]).tolist() == [0x7F7F, 0x7F80, -128]  # to nearest: unchanged, +inf, -inf


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_rounds_by_any_counters(dtype):
    """Counters given as every element's index (a TP shard's), some past 2^32 (their high half mixed in)."""
    opt = AdamW(0.9, 0.999, 1e-6, weight_decay=0.1)
    ctx = StepContext(lr=3e-3, step=2, global_norm=1.0, grad_factor=1.0)
    start = case(dtype)
    indices = torch.randperm(N, generator=torch.Generator().manual_seed(3)) + ((1 << 32) - N // 2)
    ops = {k: t.clone() for k, t in start.items()}
    ops_update(opt, "w", ops, ctx, indices)
    kernel = {k: t.clone() for k, t in start.items()}
    fused.adamw_(kernel["w"], kernel["g"], kernel["m"], kernel["v"], opt.scalars("w", ctx), (KEY, indices))
    assert_same_bits(kernel, ops)


@needs_kernel
@pytest.mark.parametrize("signed", [True, False], ids=["m", "v"])
def test_the_kernel_encodes_every_float_next_to_a_bound_as_the_codebook(signed, build):
    """Each of the 255 bounds and the 64 float32 values either side of it, the map's values, zeros, ±1, ±inf, the
    smallest normals and subnormals, floats either side of 2^-23 and beyond ±1, the first, middle and last float of
    each of the 2^17 buckets (the kernel's table has a word for each; NaNs included), and 10^5 uniform draws: the
    kernel's codes are the torch ops' (the count of bounds below each, which test_adamw8bit checks against
    ``searchsorted``)."""
    book = Codebook(signed)
    near = (book.bounds.view(torch.int32)[:, None] + torch.arange(-64, 65, dtype=torch.int32)).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, 1.2e-38, -1.2e-38, 1e-45, -1e-45, 2.0**-23,
                            -(2.0**-23), 2.0**-24, -(2.0**-24), 3e-7, -3e-7, math.nan, -math.nan, 1.0000001,
                            -1.0000001, 1.5, -1.5, 3e38, -3e38])
    ends = (torch.arange(1 << 17, dtype=torch.int64)[:, None] << 15) + torch.tensor([0, 0x3FFF, 0x7FFF])
    ends = torch.where(ends >= 1 << 31, ends - (1 << 32), ends).int().view(torch.float32)  # the bit patterns' floats
    special = torch.cat([special, ends.view(-1)])
    draws = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * (2 if signed else 1) - (1 if signed else 0)
    x = torch.cat([near.reshape(-1), book.tables(torch.device("cpu"))[0], special, draws])
    expected = book.encode(x)
    codes = torch.empty_like(x, dtype=torch.uint8)
    fused.encode8_(codes, x, book.tables(torch.device("cpu")))
    assert torch.equal(codes, expected)


@needs_kernel
def test_the_kernel_refuses_a_table_it_would_read_past():
    """The kernel reads a map's table at ``bits >> 15``: a shorter one (the 46 KiB layout of before) is refused
    before any read."""
    book = Codebook(True)
    values, base, bound, words = book.tables(torch.device("cpu"))
    assert words.numel() == 1 << 17 and words.dtype == torch.int32
    x, codes = torch.zeros(64), torch.empty(64, dtype=torch.uint8)
    with pytest.raises(AssertionError):
        fused.encode8_(codes, x, (values, base, bound, words[: 2 * (23 * 256 + 3)].clone()))


@needs_kernel
@pytest.mark.parametrize(("dtype", "grad_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.bfloat16, torch.float32), (torch.float16, torch.float16)],
                         ids=["float32", "bf16-sr", "bf16-sr-float32-grad", "fp16-sr-general-loop"])
@pytest.mark.parametrize("block", [64, 256])
def test_the_8bit_kernel_is_the_ops_bit_for_bit(dtype, grad_dtype, block, build):
    """Codes, absmax, weights: the same as dequantize → ``adamw``'s ops → quantize, over three steps, a short
    last block included, in pieces cut on block boundaries; norms' float32 moments go through ``adamw_``."""
    check_8bit_update(dtype, grad_dtype, block)


def check_8bit_update(dtype: torch.dtype, grad_dtype: torch.dtype, block: int) -> None:
    """The 8-bit update of ``fused_step`` (the C kernel, or where routed there the compiled one) against the ops."""
    opt = AdamW8bit(0.9, 0.999, 1e-6, 0.1, block)
    n = 40 * block + block // 3
    start = case(dtype, n)
    w = start["w"]
    states = {}
    for way in ("ops", "kernel"):
        state = {k: torch.zeros(n, dtype=torch.uint8) for k in ("m", "v")}
        state |= {k: torch.zeros(-(-n // block)) for k in ("m_absmax", "v_absmax")}
        states[way] = (w.clone(), state)
    for step in (1, 2, 3):
        ctx = StepContext(lr=3e-3, step=step, global_norm=1.0, grad_factor=0.5)
        grad = (torch.randn(n, generator=torch.Generator().manual_seed(step)) * 1e-2).to(grad_dtype)
        weight, state = states["ops"]
        view = weight if dtype == torch.float32 else weight.float()
        opt.step_unit(["h.0.mlp.weight"], [view], [grad.float() * 0.5], [state], ctx)
        if view is not weight:
            stochastic_round_(weight, view, KEY, lambda a, c: a)
        weight, state = states["kernel"]
        cuts = [0, 7 * block, 8 * block, n]
        pieces = list(itertools.pairwise(cuts))
        assert opt.fused_step(
            ["h.0.mlp.weight"] * 3, [weight[a:b] for a, b in pieces], [grad[a:b] for a, b in pieces],
            [{"m": state["m"][a:b], "v": state["v"][a:b], "m_absmax": state["m_absmax"][a // block : -(-b // block)],
              "v_absmax": state["v_absmax"][a // block : -(-b // block)]} for a, b in pieces], ctx,
            [None if dtype == torch.float32 else (KEY, a) for a, _ in pieces])
    assert_same_bits(dict(zip("w", [states["kernel"][0]])) | states["kernel"][1],
                     dict(zip("w", [states["ops"][0]])) | states["ops"][1])
    assert int(states["kernel"][1]["m"].ne(0).sum()) > n // 2  # the codes really moved



@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bf16-sr", "fp16-sr-general-loop"])
def test_the_8bit_kernel_decodes_every_code_at_every_position_as_the_ops(dtype, build):
    """Each of the 256 codes of both maps at each of the 64 positions of a group (the byte permutes decode 64
    codes at a time, their groups of 4 transposed), and a short group at the end: decoded, updated and encoded
    again, the weights, codes and absmax are the ops' bit for bit."""
    block, groups = 256, 256
    n = 64 * groups + 37
    position, group = torch.arange(n) % 64, torch.arange(n) // 64
    codes = {"m": ((group + 5 * position) % 256).to(torch.uint8),
             "v": ((group * 3 + 11 * position) % 256).to(torch.uint8)}
    assert all(len(set(c[position == p].tolist())) == 256 for c in codes.values() for p in (0, 17, 63))
    g = torch.Generator().manual_seed(7)
    absmax = {"m_absmax": torch.rand(-(-n // block), generator=g) * 1e-2 + 1e-4,
              "v_absmax": torch.rand(-(-n // block), generator=g) * 1e-4 + 1e-6}
    w, grad = (torch.randn(n, generator=g) * 0.02).to(dtype), torch.randn(n, generator=g) * 1e-2
    opt = AdamW8bit(0.9, 0.999, 1e-6, 0.1, block)
    ctx = StepContext(lr=3e-3, step=4, global_norm=1.0, grad_factor=1.0)
    out = {}
    for way in ("ops", "kernel"):
        state = {k: c.clone() for k, c in codes.items()} | {k: a.clone() for k, a in absmax.items()}
        weight = w.clone()
        if way == "ops":
            view = weight if dtype == torch.float32 else weight.float()
            opt.step_unit(["h.0.mlp.weight"], [view], [grad.clone()], [state], ctx)
            if view is not weight:
                stochastic_round_(weight, view, KEY, lambda a, c: a)
        else:
            assert opt.fused_step(["h.0.mlp.weight"], [weight], [grad], [state], ctx,
                                  [None if dtype == torch.float32 else (KEY, 0)])
        out[way] = {"w": weight} | state
    assert_same_bits(out["kernel"], out["ops"])


@needs_kernel
def test_the_8bit_bfloat16_loop_rounds_its_largest_values_inf_and_nan_as_the_ops_in_any_chunk(build):
    """The 8-bit update's bfloat16 loop rounds in chunks of 64 as the float32-moment one does: values next to
    bfloat16's largest, infinities and a NaN at a chunk's ends, several in one chunk, and in a block's short tail,
    round as the ops do (a NaN with the ops' bits, as in the test above); so do their neighbours, and the codes
    match."""
    block, n = 256, 3 * 256 + 100
    opt = AdamW8bit(0.9, 0.999, 1e-6, 0.0, block)
    ctx = StepContext(lr=1e36, step=2, global_norm=1.0, grad_factor=0.5)
    g = torch.Generator().manual_seed(9)
    w, grad = (torch.randn(n, generator=g) * 0.02).bfloat16(), torch.randn(n, generator=g) * 1e-2
    largest = torch.finfo(torch.bfloat16).max
    for at, value in {0: largest, 63: -largest, 65: math.inf, 66: -math.inf, 67: math.nan, 256 + 127: largest,
                      3 * 256 + 70: -largest, n - 1: math.inf}.items():
        w[at], grad[at] = value, -1e-2 if value > 0 else 1e-2
    out = {}
    for way in ("ops", "kernel"):
        state = {k: torch.zeros(n, dtype=torch.uint8) for k in ("m", "v")}
        state |= {k: torch.zeros(-(-n // block)) for k in ("m_absmax", "v_absmax")}
        weight = w.clone()
        if way == "ops":
            view = weight.float()
            opt.step_unit(["h.0.mlp.weight"], [view], [grad * 0.5], [state], ctx)
            stochastic_round_(weight, view, KEY, lambda a, c: a)
        else:
            assert opt.fused_step(["h.0.mlp.weight"], [weight], [grad], [state], ctx, [(KEY, 0)])
        out[way] = {"w": weight} | state
    assert out["ops"]["w"].isnan().nonzero().flatten().tolist() == [67]
    assert_same_bits(out["kernel"], out["ops"])
    assert bits(out["kernel"]["w"][[65, 66]]).tolist() == [0x7F80, -128]


@needs_kernel
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_the_8bit_kernel_keeps_the_ops_codes_of_a_non_finite_block(bad):
    """A block whose moments are not finite (an infinite or NaN gradient: its absmax infinite or NaN, its
    normalized values NaN): its codes and absmax, and the finite blocks' beside it, are the ops' bit for bit."""
    block, n = 64, 4 * 64
    opt = AdamW8bit(0.9, 0.999, 1e-6, 0.0, block)
    grad = torch.randn(n, generator=torch.Generator().manual_seed(5)) * 1e-2
    grad[block + 3] = bad
    ctx = StepContext(lr=3e-3, step=1, global_norm=1.0, grad_factor=1.0)
    out = {}
    for way in ("ops", "kernel"):
        w = torch.randn(n, generator=torch.Generator().manual_seed(6))
        state = {k: torch.zeros(n, dtype=torch.uint8) for k in ("m", "v")}
        state |= {k: torch.zeros(n // block) for k in ("m_absmax", "v_absmax")}
        if way == "ops":
            opt.step_unit(["h.0.mlp.weight"], [w], [grad.clone()], [state], ctx)
        else:
            assert opt.fused_step(["h.0.mlp.weight"], [w], [grad.clone()], [state], ctx, [None])
        out[way] = {"w": w} | state
    assert_same_bits(out["kernel"], out["ops"])
    assert not out["kernel"]["m_absmax"][1].isfinite()


def before(opt: AdamW, t: dict[str, torch.Tensor], ctx: StepContext) -> None:
    """The update before the kernel (``adamw``'s foreach chain as it was), on float32 ``t`` in place."""
    grad = t["g"] * ctx.grad_factor
    m, v, w = t["m"], t["v"], t["w"]
    bias1, bias2 = 1.0 - opt.beta1**ctx.step, 1.0 - opt.beta2**ctx.step
    m.lerp_(grad, 1.0 - opt.beta1)
    v.mul_(opt.beta2).addcmul_(grad, grad, value=1.0 - opt.beta2)
    denom = v.clamp_min(opt.sqrt_floor(bias2) or 0.0).sqrt().div_(math.sqrt(bias2)).add_(opt.eps)
    w.mul_(1.0 - ctx.lr * opt.weight_decay)
    w.addcdiv_(m, denom, value=-ctx.lr / bias1)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many float32 values apart ``a`` and ``b`` are (same signs here)."""
    return (bits(a).long() - bits(b).long()).abs()


@needs_kernel
def test_within_a_few_ulps_a_step_of_the_update_before():
    """Against the update before it, over ten steps: the new order rounds ``β1·m + (1-β1)·g`` as two products and a
    sum (``lerp`` fused them: half an ulp of each product more), ``(g·g)·(1-β2)`` likewise, and a correctly
    rounded ``√v`` (ATen's CPU one is off by an ulp in a sixth of the elements). So each moment moves by an ulp
    or two of its terms (``|β1·m| + |(1-β1)·g|``: where they cancel, that is many ulps of ``m`` itself), the
    denominator by an ulp, and the weight by 2 ulps of itself (before and after) plus 4 ulps of the step its
    moments' terms would make, ``lr/bias1 · terms / d``, each step, the earlier steps' differences carried
    (measured: half of that bound at most). In bfloat16 with stochastic rounding, both take the same decision on
    each element whose float32 values agree."""
    opt = AdamW(0.9, 0.999, 1e-6, weight_decay=0.1)
    old = case(torch.float32, THREADED)
    new = {k: t.clone() for k, t in old.items()}
    lr, allowed = 1e-3, torch.zeros(THREADED)
    moments = {"m": torch.zeros(THREADED), "v": torch.zeros(THREADED)}  # their bounds, carried by β1, β2
    for step in range(1, 11):
        ctx = StepContext(lr=lr, step=step, global_norm=2.0, grad_factor=0.5)
        grad = torch.randn(THREADED, generator=torch.Generator().manual_seed(step)) * 1e-2
        old["g"], new["g"] = grad, grad.clone()
        terms = {"m": old["m"].abs() * 0.9 + (grad * 0.5).abs() * 0.1,
                 "v": old["v"] * 0.999 + (grad * 0.5).square() * 1e-3}
        w_before = old["w"].clone()
        before(opt, old, ctx)
        fused.adamw_(new["w"], new["g"], new["m"], new["v"], opt.scalars("w", ctx, ctx.grad_factor))
        for k, beta in (("m", 0.9), ("v", 0.999)):
            moments[k] = moments[k] * beta + 2.0**-22 * terms[k]
            assert bool(((new[k] - old[k]).abs() <= moments[k]).all()), k
        bias1, bias2 = 1 - 0.9**step, 1 - 0.999**step
        moved = lr / bias1 * terms["m"] / (old["v"].sqrt() / math.sqrt(bias2) + 1e-6)
        allowed += 2.0**-22 * (w_before.abs() + old["w"].abs()) + step * 2.0**-21 * moved
        assert bool(((new["w"] - old["w"]).abs() <= allowed).all()), step
    assert int(ulps(new["w"], old["w"]).gt(0).sum()) > THREADED // 10  # they do differ: the bound is what is tested
    # stochastic rounding of two float32 results: the same 16-bit value wherever they agree
    w16 = {k: torch.empty(THREADED, dtype=torch.bfloat16) for k in ("old", "new")}
    stochastic_round_(w16["old"], old["w"], KEY, lambda a, c: a)
    stochastic_round_(w16["new"], new["w"], KEY, lambda a, c: a)
    same = old["w"] == new["w"]
    assert torch.equal(w16["old"][same], w16["new"][same])
    assert int((w16["old"] != w16["new"]).sum()) <= int((~same).sum()) // 100 + 1  # a 2^-16 chance each


@needs_kernel
@pytest.mark.parametrize("recipe", [(), ("model.precision=bfloat16", "training.stochastic_rounding=true")],
                         ids=["float32", "bf16-sr"])
def test_the_engine_updates_with_the_kernel(hooks, make_config, monkeypatch, recipe):
    """Every update call of a run goes through the kernel, and the run equals the ops' one bit for bit."""
    calls = []
    adamw_ = fused.adamw_
    monkeypatch.setattr(fused, "adamw_", lambda *a, **k: calls.append(1) or adamw_(*a, **k))
    runs = {}
    for kernel in (True, False):
        calls.clear()
        monkeypatch.setitem(fused._state, "lib", fused.library() if kernel else None)
        cfg = make_config(*EQUIVALENCE, *recipe)
        engine = make_engine(cfg, hooks)
        runs[kernel] = ([r.loss for r in run_engine(engine, cfg)], engine.model.full_weights(),
                        engine.model.full_weights("optim"))
        assert bool(calls) == kernel
    assert runs[True][0] == runs[False][0]
    for got, want in zip(runs[True][1:], runs[False][1:], strict=True):
        for unit, tensors in want.items():
            for name, t in tensors.items():
                assert torch.equal(got[unit][name], t), f"{unit}.{name}"


@needs_kernel
@pytest.mark.parametrize("recipe", [("model.precision=bfloat16", "training.stochastic_rounding=true"),
                                    ("training.optimizer.name=adamw8bit",)], ids=["bf16-sr", "adamw8bit"])
def test_a_150_step_run_has_the_ops_loss_curve(capsys, tmp_path, monkeypatch, recipe):
    """150 steps of the tiny preset, clipping active: with the kernel every step's loss and gradient norm are the
    torch ops' exactly (the same arithmetic: the same curve, not a near one)."""
    curves, calls = {}, []
    for name in ("adamw_", "adamw8bit_"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    for kernel in (True, False):
        calls.clear()
        monkeypatch.setitem(fused._state, "lib", fused.library() if kernel else None)
        out = tmp_path / f"kernel-{kernel}"
        code, _, err = run_cli(capsys, "train", "--config", "tiny", "training.steps=150", f"output_dir={out}",
                               "training.global_batch_size=4", "training.optimizer.learning_rate.maximum=1e-3",
                               "training.optimizer.gradient_clipping=0.5", *recipe)
        assert code == 0, err
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        curves[kernel] = [(r["loss"], r["grad_norm"]) for r in rows if "grad_norm" in r]
        assert bool(calls) == kernel
    assert len(curves[True]) == 150 and curves[True] == curves[False]
    assert curves[True][-1][0] < curves[True][0][0]  # it trains
    assert any(norm > 0.5 for _, norm in curves[True])  # and clips


@needs_kernel
def test_the_kernel_runs_on_torchs_openmp_threads():
    """Built with OpenMP, the kernel's ranges run on the runtime torch's ops run on: one libgomp in the process,
    so torch's threads (which spin for milliseconds after each op) are the kernel's, not rivals for the cores."""
    if not fused.library().ipuft_openmp():
        pytest.skip("this compiler builds the kernel without OpenMP: it starts threads of its own")
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps to read the loaded libraries from")
    assert len({line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}) == 1


@needs_kernel
def test_a_compiler_without_openmp_builds_threads_of_the_kernels_own(monkeypatch, tmp_path):
    """Where the compiler refuses ``-fopenmp``, the build without it: the same update bit for bit, over threads
    it starts itself; the next process takes that build from the cache without asking the compiler again."""
    real = shutil.which(os.environ.get("CC", "cc"))
    wrapper, calls = tmp_path / "cc", tmp_path / "calls"
    wrapper.write_text(f'#!/bin/sh\necho x >> {calls}\nfor a in "$@"; do [ "$a" = -fopenmp ] && '
                       f'{{ echo "cc: error: -fopenmp" >&2; exit 1; }}; done\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("IPUFT_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fused, "_state", {})
    assert fused.library().ipuft_openmp() == 0
    assert len(calls.read_text().splitlines()) == 2  # with -fopenmp, refused; without
    monkeypatch.setattr(fused, "_state", {})  # a new process
    assert fused.library().ipuft_openmp() == 0
    assert len(calls.read_text().splitlines()) == 2
    opt = AdamW(0.9, 0.999, 1e-6, weight_decay=0.1)
    ctx = StepContext(lr=3e-3, step=2, global_norm=1.0, grad_factor=0.5)
    ops, kernel = case(torch.bfloat16, THREADED), case(torch.bfloat16, THREADED)
    ops_update(opt, "h.0.mlp.weight", ops, ctx, 0)
    fused.adamw_(kernel["w"], kernel["g"], kernel["m"], kernel["v"],
                 opt.scalars("h.0.mlp.weight", ctx, ctx.grad_factor), (KEY, 0))
    assert_same_bits(kernel, ops)


def test_without_a_compiler_the_ops_update_and_one_line_says_so(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("IPUFT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(fused, "_state", {})
    assert fused.library() is None and fused.library() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no C compiler ('no-such-compiler'" in err[0] and "torch ops" in err[0]
    assert not fused.serves(torch.zeros(4), torch.zeros(4), None)
