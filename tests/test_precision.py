"""16-bit training: bfloat16 and float16 weights, updated by stochastic rounding or through float32 master
weights, against float32 and against a plain single-module autograd reference of the same recipe."""

import contextlib
import math

import pytest
import torch
from test_engine import batches, make_engine

from ipuft.config import load_config
from ipuft.data.tokens import data_source
from ipuft.engine.variables import MASTER
from ipuft.ops import WeightGradients, taking_weight_gradients
from ipuft.plan.estimate import estimate
from ipuft.precision import _round_by_neighbours, random_bits, round_stochastically, rounding_key
from ipuft.run.runtime import build_engine
from ipuft.run.schedule import learning_rate
from ipuft.run.train import replica_batch

BF16_SR = ("model.precision=bfloat16", "training.stochastic_rounding=true")
BF16_MASTER = ("model.precision=bfloat16", "training.master_weights=true")
BF16_NEAREST = ("model.precision=bfloat16",)
FP16_SR = ("model.precision=float16", "training.stochastic_rounding=true", "execution.loss_scaling=dynamic")
FP16_MASTER = ("model.precision=float16", "training.master_weights=true", "execution.loss_scaling=dynamic")


def train_steps(hooks, overrides, steps):
    """``steps`` optimizer steps of the tiny preset on its data; the step results and the engine."""
    cfg = load_config("tiny", [f"training.steps={steps}", *overrides], hooks.registrations.config_sections)
    engine = build_engine(cfg, hooks)
    data = data_source(cfg)
    results = [engine.step(replica_batch(cfg, data, s, engine.layout),
                           learning_rate(s, steps, cfg.training.optimizer.learning_rate)) for s in range(steps)]
    return results, engine


def last_mean(results, n=5):
    return sum(r.loss for r in results[-n:]) / n


# -- the rounding itself --------------------------------------------------------------------------------


def neighbours(x: float, dtype):
    """The two values of ``dtype`` around float ``x``."""
    near = torch.tensor(x).to(dtype)
    toward = torch.tensor(math.inf if near.float() < x else -math.inf).to(dtype)
    other = torch.nextafter(near, toward)
    return sorted((near.float().item(), other.float().item()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("x", [1.0 + 0.3 * 2**-7, -3.7, 0.0123456, 1e-6, -2.5e-7])
def test_stochastic_rounding_is_unbiased(dtype, x):
    n = 1 << 20
    x = torch.tensor(x).item()  # the float32 value
    lo, hi = neighbours(x, dtype)
    assert lo < x < hi
    bits = random_bits(rounding_key(0, "unit", "w", 1), torch.arange(n))
    rounded = round_stochastically(torch.full((n,), x), dtype, bits)
    assert rounded.dtype == dtype
    assert set(rounded.float().unique().tolist()) == {lo, hi}
    p = (x - lo) / (hi - lo)
    # The mean of n independent roundings: within 5 standard errors of x (a false alarm once in 1.7 million);
    # round-to-nearest would sit min(p, 1-p)·(hi-lo) away, hundreds of standard errors.
    standard_error = (hi - lo) * math.sqrt(p * (1 - p) / n)
    assert abs(rounded.double().mean().item() - x) <= 5 * standard_error
    assert min(p, 1 - p) * (hi - lo) > 50 * standard_error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_stochastic_rounding_keeps_representable_values(dtype):
    values = torch.tensor([0.0, 1.0, -2.0, 0.5, 3.0, -0.0]).to(dtype)
    bits = random_bits(7, torch.arange(values.numel()))
    assert torch.equal(round_stochastically(values.float(), dtype, bits), values)


def test_random_bits_are_a_pure_function_of_key_and_index():
    index = torch.arange(1 << 16) * 977 + (1 << 33)  # indices past 2^32 use their high bits too
    bits = random_bits(12345, index)
    assert torch.equal(bits, random_bits(12345, index))
    assert torch.equal(bits[100:200], random_bits(12345, index[100:200]))  # independent of the chunking
    assert not torch.equal(bits, random_bits(12346, index))
    small = torch.arange(1000)  # indices under 2^32 take a shortcut that must give the same bits
    assert torch.equal(random_bits(12345, torch.cat([small, index]))[:1000], random_bits(12345, small))
    assert bits.min() >= 0 and bits.max() < 2**32
    uniform = bits.double() / 2**32
    assert abs(uniform.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / index.numel())
    for bit in range(32):  # every bit is a fair coin
        assert abs(((bits >> bit) & 1).double().mean().item() - 0.5) < 5 * 0.5 / math.sqrt(index.numel())


def test_random_bits_are_the_documented_hash():
    """The int32 implementation (wrapping multiplies, masked arithmetic shifts) against MurmurHash3's finaliser
    in Python integers, for indices on both sides of 2^31 and 2^32 and an odd count (the kernels' scalar tails)."""
    mask = 0xFFFFFFFF

    def mix(x):
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & mask
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & mask
        return x ^ (x >> 16)

    gen = torch.Generator().manual_seed(3)
    low = [0, 1, 2**31 - 1, 2**31, 2**32 - 1] + torch.randint(0, 2**32, (500,), generator=gen).tolist()
    high = [2**32, 2**33 + 5] + torch.randint(2**32, 2**45, (500,), generator=gen).tolist()
    for key in (0, 12345, 2**31 + 7, mask):
        for index in (low, low + high):
            expected = [mix(mix((i & mask) ^ key) ^ mix((i >> 32) ^ key ^ 0x9E3779B9)) for i in index]
            assert random_bits(key, torch.tensor(index)).tolist() == expected


# float32 bit patterns whose low bits the edge cases fill: 1.0 and the next 16-bit values (both parities),
# the largest finite values and their lower neighbours, a negative, and float16's smallest normal and the
# float32s just under it.
EDGE_BASES = {torch.bfloat16: [0x3F800000, 0x3F810000, 0x7F7F0000, 0x7F7E0000, 0xBF7F0000],
              torch.float16: [0x3F800000, 0x3F802000, 0x477FE000, 0x477FC000, 0xBF802000, 0x38800000, 0x387FE000]}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rounding_on_bit_patterns_is_the_float_formulation_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(5)
    n = 1 << 18
    exponents = torch.randint(-45, 39, (n,), generator=gen).float()
    wide = torch.randn(n, generator=gen) * 10.0**exponents  # normal and subnormal, every binade, both signs
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 3.3895e38, -3.3895e38, 3.39e38, 3.4e38,
                            3.4028235e38, 65504.0, 65519.0, 65520.0, -65520.0, 6e-5, 6.1e-5, -3e-8, 1.0 + 2**-8,
                            1.0 + 3 * 2**-8, 1.0 + 2**-11, 2.0 - 2**-20, -(2.0 - 2**-20), 1.0 + 2**-9])
    # Every dropped low part (in steps, from 0), at each base, with the 24-bit draws on either side of the
    # threshold where the neighbour away from zero starts being taken, (2^d - low)·2^(24-d), and at the extremes.
    dropped = {torch.bfloat16: 16, torch.float16: 13}[dtype]
    low = torch.arange(0, 1 << dropped, 3, dtype=torch.int64).repeat_interleave(8)
    edges = (torch.tensor(EDGE_BASES[dtype])[:, None] | low[None, :]).flatten().to(torch.int32)
    lows = edges & ((1 << dropped) - 1)
    threshold = ((1 << dropped) - lows) << (24 - dropped)
    offset = torch.tensor([-1, 0, 1, -(1 << 24), (1 << 24) - 1, 2, -2, 0], dtype=torch.int32).repeat(edges.numel() // 8)
    draws = ((threshold + offset).clamp(0, (1 << 24) - 1) << 8) | 0x5A  # the low 8 bits are never used
    for value, bits in ((wide, random_bits(11, torch.arange(n)).to(torch.int32)),
                        (special.repeat(4096), random_bits(12, torch.arange(special.numel() * 4096)).to(torch.int32)),
                        (edges.view(torch.float32), draws)):
        ours, reference = round_stochastically(value, dtype, bits), _round_by_neighbours(value, dtype, bits)
        same = (ours.view(torch.int16) == reference.view(torch.int16)) | (ours.isnan() & reference.isnan())
        assert bool(same.all()), value[~same][:5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_draw_from_which_the_neighbour_away_from_zero_is_taken(dtype):
    """A quarter of a step past 1 (and past -1): the neighbour away from zero exactly where the draw's top d bits
    reach 2^d - low = 3·2^(d-2), whatever the bits under them; so with probability 1/4."""
    d = {torch.bfloat16: 16, torch.float16: 13}[dtype]
    step = 2.0 ** -(23 - d)
    value = torch.tensor([1.0 + step / 4, -1.0 - step / 4] * 2)
    first = 3 << (d - 2)
    below = ((first - 1) << (32 - d)) | ((1 << (32 - d)) - 1)  # just under: every lower bit set
    at = first << (32 - d)  # exactly there: no lower bit set
    bits = torch.tensor([below, below, at, at], dtype=torch.int64)
    rounded = round_stochastically(value, dtype, bits).float().tolist()
    assert rounded == [1.0, -1.0, 1.0 + step, -1.0 - step]
    assert torch.equal(_round_by_neighbours(value, dtype, bits.to(torch.int32)).float(), torch.tensor(rounded))


# -- training ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", [BF16_SR, BF16_MASTER, FP16_SR, FP16_MASTER],
                         ids=["bf16-sr", "bf16-master", "fp16-sr-dynamic", "fp16-master-dynamic"])
def test_16bit_training_tracks_float32(hooks, recipe):
    """tiny, lr 1e-3, 40 steps, no dropout: the mean loss of the last 5 steps within 3% of float32's."""
    common = ("training.optimizer.learning_rate.maximum=1e-3",)
    reference, _ = train_steps(hooks, common, 40)
    results, engine = train_steps(hooks, (*common, *recipe), 40)
    assert reference[0].loss - last_mean(reference) > 0.5  # float32 really learns
    assert abs(last_mean(results) - last_mean(reference)) <= 0.03 * last_mean(reference)
    assert sum(r.skipped for r in results) <= 3
    assert all(t.dtype == engine.model.dtype for t in engine.model.weights()["decoder.0"].values())


def test_stochastic_rounding_and_master_weights_learn_where_rounding_to_nearest_cannot(hooks):
    """At a learning rate far under half a bfloat16 step of the weights (lr 3e-6 against steps of about 1e-4
    at |w| ≈ 0.02), round-to-nearest leaves nearly every weight unchanged and the loss nearly flat: only
    weights within about 1e-3 of zero, whose steps are small enough, still move. Stochastic rounding and
    master weights follow float32."""
    common = ("training.optimizer.learning_rate.maximum=3e-6", "training.optimizer.learning_rate.warmup_proportion=0",
              "plugins.adamw.weight_decay=0", "model.layers=1")
    steps = 60
    runs = {name: train_steps(hooks, (*common, *recipe), steps)
            for name, recipe in {"float32": (), "nearest": BF16_NEAREST, "sr": BF16_SR, "master": BF16_MASTER}.items()}
    initial = {name: make_engine(engine.cfg, hooks).model.weights() for name, (_, engine) in runs.items()}

    def drop(name):
        results = runs[name][0]
        return sum(r.loss for r in results[:5]) / 5 - last_mean(results)

    def changed(name):
        before, after = initial[name], runs[name][1].model.weights()
        total = sum(t.numel() for w in before.values() for t in w.values())
        moved = sum(int((after[u][n] != t).sum()) for u, w in before.items() for n, t in w.items())
        return moved / total

    assert drop("float32") > 0.01 and changed("float32") > 0.95
    assert abs(drop("nearest")) < 0.25 * drop("float32")
    assert changed("nearest") < 0.1
    for name in ("sr", "master"):
        assert abs(drop(name) - drop("float32")) < 0.05 * drop("float32"), name
        assert changed(name) > 0.5, name


def test_master_weights_are_float32_state_and_the_weights_are_cast_from_them(hooks):
    _, engine = train_steps(hooks, BF16_MASTER, 3)
    optim = engine.store.entries["decoder.1"]["optim"]
    for name, weight in engine.model.weights()["decoder.1"].items():
        master = optim[f"{name}.{MASTER}"]
        assert master.dtype == torch.float32 and weight.dtype == torch.bfloat16
        assert torch.equal(weight, master.to(torch.bfloat16))


# -- plan and counters ---------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", [BF16_SR, FP16_MASTER], ids=["bf16-sr", "fp16-master"])
@pytest.mark.parametrize("activation_offload", [True, False])
def test_16bit_counters_equal_the_plan(hooks, make_config, recipe, activation_offload):
    cfg = make_config("training.global_batch_size=4", f"execution.activation_offload={activation_offload}", *recipe)
    engine = make_engine(cfg, hooks)
    planned = estimate(cfg, engine.parts, hooks)
    for batch in batches(cfg)[:2]:
        result = engine.step(batch, 1e-3)
        assert result.traffic == planned["traffic"]
        assert result.activation_bytes == planned["activation_bytes"] == 3 * 4 * 8 * 64 * 2
        assert result.variable_bytes == planned["variable_bytes"]
        assert result.device_peak_bytes <= planned["device_peak_bytes"]
    assert engine.store.host_bytes() == planned["variable_bytes"]


def test_bfloat16_halves_the_weight_traffic(hooks, make_config):
    traffic = {}
    for precision in ("float32", "bfloat16"):
        cfg = make_config("training.global_batch_size=4", "execution.activation_offload=true",
                          f"model.precision={precision}")
        result = make_engine(cfg, hooks).step(batches(cfg)[0], 1e-3)
        traffic[precision] = result.traffic
    for direction in ("h2d", "d2h"):
        assert traffic["bfloat16"][direction]["fwd"] * 2 == traffic["float32"][direction]["fwd"]
        assert traffic["bfloat16"][direction]["activation"] * 2 == traffic["float32"][direction]["activation"]
        assert traffic["bfloat16"][direction]["optim"] == traffic["float32"][direction]["optim"]  # Adam stays float32


# -- the phased engine against a plain reference -------------------------------------------------------


def plain_16bit_reference(cfg, modules, initial, step_batches, ties=None, frozen=lambda unit, name: False,
                          head=lambda batch, mb: contextlib.nullcontext()):
    """The whole model as one module (the components composed with ``functional_call``), torch autograd
    over each micro-batch, gradients summed in float32 and rounded once to the weights' dtype (the
    projections' weights over every micro-batch's tokens at once, see below), and the
    adamw update of ``ipuft_optim_adam`` written out in float32, rounded stochastically into the weights with
    the same counter-based bits (element i of a variable is element i: one process). ``ties`` maps a
    ``(unit, variable)`` that uses another's weight to its owner's: each use is a leaf of its own, and the
    owner's gradient is the float32 sum of every use's. ``frozen(unit, variable)``: the variables that take no
    gradient and no update (a LoRA base). ``head(batch, mb)``: a context the head's loss runs under (preference
    pairs)."""
    from torch.func import functional_call

    o, a, S = cfg.training.optimizer, cfg.plugins.adamw, cfg.execution.loss_scaling
    ties = ties or {}
    weights = {u: {n: t.clone() for n, t in w.items()} for u, w in initial.items()}
    m, v, losses, norms = {}, {}, [], []
    for step, batch in enumerate(step_batches):
        for (u, n), (owner, name) in ties.items():
            weights.setdefault(u, {})[n] = weights[owner][name]
        ga, sums, step_loss = batch.micro_batches, {}, 0.0
        # The projections' weights are taken over the whole step (one product over every micro-batch's tokens,
        # summed in float32 and rounded once, as ipuft.ops takes them: tests/test_ops.py holds take() to
        # autograd's gradient); every other gradient is autograd's per micro-batch, summed in float32.
        leaves = {u: {n: t.detach().requires_grad_(not frozen(u, n)) for n, t in w.items()} for u, w in weights.items()}
        taken = WeightGradients([t for w in leaves.values() for t in w.values() if t.requires_grad])
        with taking_weight_gradients(taken):
            for mb in range(ga):
                h = functional_call(modules["embeddings"], leaves["embeddings"], (batch.input_ids[mb],))
                for n in range(cfg.model.layers):
                    h = functional_call(modules["decoder"], leaves[f"decoder.{n}"], (h,))
                with head(batch, mb):
                    loss = functional_call(modules["head"], leaves["head"], (h, batch.labels[mb]))
                (loss * (S / ga)).backward()
                step_loss += loss.item() / ga
                for u, w in leaves.items():
                    for n, p in w.items():
                        if p.grad is not None:
                            sums[u, n] = sums[u, n] + p.grad.float() if (u, n) in sums else p.grad.float()
                            p.grad = None
        names = {id(p): (u, n) for u, w in leaves.items() for n, p in w.items()}
        sums.update({names[id(leaf)]: grad for leaf, grad in taken.take()})
        for user, owner in ties.items():
            sums[owner] = sums[owner] + sums.pop(user)
        grads = {k: g.to(weights[k[0]][k[1]].dtype).float() for k, g in sums.items()}
        norm = math.sqrt(sum(float((g / S).double().pow(2).sum()) for g in grads.values()))
        lr = learning_rate(step, cfg.training.steps, o.learning_rate)
        scale = (1 / S) * o.gradient_clipping / max(norm, o.gradient_clipping)
        t = step + 1
        for (u, n), summed in grads.items():
            g = summed * scale
            w = weights[u][n].float()
            m[u, n] = a.beta1 * m.get((u, n), 0) + (1 - a.beta1) * g
            v[u, n] = a.beta2 * v.get((u, n), 0) + (1 - a.beta2) * g * g
            update = (m[u, n] / (1 - a.beta1**t)) / ((v[u, n] / (1 - a.beta2**t)).sqrt() + a.eps)
            if not ("norm" in n or "bias" in n):
                update = update + a.weight_decay * w
            w = w - lr * update
            bits = random_bits(rounding_key(cfg.model.seed, u, n, t), torch.arange(w.numel()))
            weights[u][n] = round_stochastically(w.reshape(-1), weights[u][n].dtype, bits).view(w.shape)
        losses.append(step_loss)
        norms.append(norm)
    for u, n in ties:
        del weights[u][n]
    return losses, norms, weights


def step_at(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The 16-bit step (the distance to the next value up) at the larger of the two magnitudes."""
    big = torch.maximum(a.float().abs(), b.float().abs()).to(a.dtype)
    return torch.nextafter(big, torch.full_like(big, math.inf)).float() - big.float()


@pytest.mark.parametrize("activation_offload", [False, True])
def test_phased_bfloat16_equals_a_plain_bfloat16_reference(hooks, make_config, activation_offload):
    from test_engine import EQUIVALENCE

    cfg = make_config(*EQUIVALENCE, *BF16_SR, f"execution.activation_offload={activation_offload}")
    engine = make_engine(cfg, hooks)
    initial = {u: {n: t.clone() for n, t in w.items()} for u, w in engine.model.weights().items()}
    step_batches = batches(cfg)
    results = [engine.step(b, learning_rate(s, cfg.training.steps, cfg.training.optimizer.learning_rate))
               for s, b in enumerate(step_batches)]
    losses, norms, weights = plain_16bit_reference(cfg, engine.modules, initial, step_batches)
    float32 = plain_16bit_reference(cfg, engine.modules, {u: {n: t.float() for n, t in w.items()}
                                                          for u, w in initial.items()}, step_batches)[2]
    assert_16bit_close(cfg, results, engine.model.weights(), (losses, norms, weights), float32, torch.bfloat16)


BFLOAT16_ROUNDING = 2.0**-8  # the relative spacing of bfloat16 values: one rounding of a result


def assert_16bit_close(cfg, results, got, expected, float32, dtype, share=0.25):
    """The run's losses, norms and 16-bit weights ``got`` against ``expected`` = (losses, norms, weights) of
    another computation of the same recipe, whose float32 twin ended at ``float32``.

    The two differ in the float32 summation order inside matmuls (kernels, blocking, the recompute's
    gradient-only projections, DP/TP reductions). A bfloat16 result rounds to 8 significant bits, so such a
    difference sometimes flips one rounding, and the flip propagates through every later gradient. Hence:
    the loss and norm agree to one bfloat16 rounding; Adam moves an element by about lr whatever its
    gradient's size, and stochastic rounding may then land one 16-bit step away, so each weight is within
    one step plus 2·lr per step; and the total weight difference is a small ``share`` of what the 16-bit
    recipe itself changes against float32, which any systematic error would reach.
    """
    losses, norms, weights = expected
    for r, loss, norm in zip(results, losses, norms, strict=True):
        assert r.loss == pytest.approx(loss, rel=BFLOAT16_ROUNDING)
        assert r.grad_norm == pytest.approx(norm, rel=BFLOAT16_ROUNDING)
    lr_sum = sum(learning_rate(s, cfg.training.steps, cfg.training.optimizer.learning_rate)
                 for s in range(cfg.training.steps))
    gap = recipe_gap = 0.0
    for unit, w in weights.items():
        for name, want in w.items():
            actual = got[unit][name]
            assert actual.dtype == want.dtype == dtype
            apart = (actual.float() - want.float()).abs()
            assert bool((apart <= step_at(actual, want) + 2 * lr_sum).all()), f"{unit}.{name}"
            gap += float(apart.sum())
            recipe_gap += float((float32[unit][name].float() - want.float()).abs().sum())
    assert gap <= share * recipe_gap, (gap, recipe_gap)
