"""How the engine runs a component (``bound``) and the decoder's CPU kernels, against plain references."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from ipuft.components import bound
from ipuft_decoder.block import GPTJDecoderBlock, apply_interleaved_rotary, gelu_new


def _block_and_weights():
    torch.manual_seed(0)
    block = GPTJDecoderBlock(hidden_size=32, heads=4, head_dim=8, intermediate_size=64, rotary_dim=4)
    weights = {n: torch.randn_like(p) * 0.1 for n, p in block.named_parameters()}
    return block, weights


def test_bound_computes_like_functional_call_and_gradients_reach_the_bound_tensors():
    block, weights = _block_and_weights()
    x = torch.randn(2, 6, 32)
    seed = torch.randn(2, 6, 32)

    reference = {n: w.clone().requires_grad_() for n, w in weights.items()}
    expected = functional_call(block, reference, (x,))
    expected.backward(seed)

    leaves = {n: w.clone().requires_grad_() for n, w in weights.items()}
    with bound(block, leaves):
        out = block(x)
        out.backward(seed)
        again = block(x)  # one binding serves every call in the block
    assert torch.equal(out, expected) and torch.equal(again, expected)
    for name, leaf in leaves.items():
        assert torch.equal(leaf.grad, reference[name].grad), name


def test_bound_restores_the_parameters_even_when_the_block_raises():
    block, weights = _block_and_weights()
    before = dict(block.named_parameters())
    with pytest.raises(RuntimeError, match="inside"), bound(block, weights):
        assert block.attn.q_proj.weight is weights["attn.q_proj.weight"]
        raise RuntimeError("inside")
    assert all(p is before[n] for n, p in block.named_parameters())


def test_bound_rejects_a_name_the_module_does_not_have_and_changes_nothing():
    block, weights = _block_and_weights()
    before = dict(block.named_parameters())
    with pytest.raises(KeyError, match=r"no parameter 'attn\.qkv\.weight'"), \
            bound(block, {**weights, "attn.qkv.weight": torch.zeros(1)}):
        pass
    assert all(p is before[n] for n, p in block.named_parameters())


def test_gelu_new_matches_transformers_and_has_atens_exact_gradient():
    from transformers.activations import NewGELUActivation

    x = (torch.randn(4, 1000, dtype=torch.float64) * 4).float().requires_grad_()
    y = gelu_new(x)
    assert (y - NewGELUActivation()(x)).abs().max() < 1e-6
    assert (y - F.gelu(x, approximate="tanh")).abs().max() < 1e-6
    seed = torch.randn_like(x)
    (ours,) = torch.autograd.grad(y, x, seed)
    (aten,) = torch.autograd.grad(F.gelu(x, approximate="tanh"), x, seed)
    assert torch.equal(ours, aten)


def test_rotary_turns_only_the_rotary_pairs():
    block, _ = _block_and_weights()
    q = torch.randn(1, 5, 4, 8)
    rotated = q.clone()
    apply_interleaved_rotary(rotated, block.attn._rotor(block.attn.rotary, 0, 5, q.device))
    assert torch.equal(rotated[..., 4:], q[..., 4:])  # past rotary_dim: untouched
    assert torch.equal(rotated[:, 0], q[:, 0])  # position 0 turns by angle 0
    # Position p, pair i turns by p·10000^(-2i/rotary_dim): (a, b) → (a·cos - b·sin, a·sin + b·cos).
    p, i = 3, 1
    angle = torch.tensor(p * 10000.0 ** (-2 * i / 4))
    a, b = q[0, p, :, 2 * i], q[0, p, :, 2 * i + 1]
    torch.testing.assert_close(rotated[0, p, :, 2 * i], a * angle.cos() - b * angle.sin(), rtol=0, atol=1e-6)
    torch.testing.assert_close(rotated[0, p, :, 2 * i + 1], a * angle.sin() + b * angle.cos(), rtol=0, atol=1e-6)


def test_rotary_with_autograd_leaves_its_input_and_has_the_rotations_exact_gradient():
    """The autograd path (a rotated product, the gradient turned back by the conjugate) against the rotation
    written in real arithmetic (GPT-J's rotate-every-two with cos and sin) differentiated by autograd."""
    block, _ = _block_and_weights()
    rotor = block.attn._rotor(block.attn.rotary, 0, 5, torch.device("cpu"))
    x = torch.randn(2, 5, 4, 8, requires_grad=True)
    before = x.detach().clone()
    ours = apply_interleaved_rotary(x, rotor)
    assert torch.equal(x.detach(), before)  # the input a graph saved is not overwritten

    assert torch.equal(rotor[..., 2:], torch.ones(5, 1, 2, dtype=rotor.dtype))  # past rotary_dim: times 1
    turns = rotor[..., :2]
    cos, sin = turns.real.repeat_interleave(2, -1), turns.imag.repeat_interleave(2, -1)  # [T, 1, rotary_dim]
    head, tail = x[..., :4], x[..., 4:]
    every_two = torch.stack((-head[..., 1::2], head[..., ::2]), -1).flatten(-2)
    expected = torch.cat((head * cos + every_two * sin, tail), -1)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)

    seed = torch.randn_like(x)
    (grad,) = torch.autograd.grad(ours, x, seed)
    (reference,) = torch.autograd.grad(expected, x, seed)
    torch.testing.assert_close(grad, reference, rtol=0, atol=1e-6)  # float32 rounding of a rotation


def test_gelu_new_in_bfloat16_is_correctly_rounded_with_atens_16_bit_gradient():
    """The 16-bit CPU path computes the float32 sigmoid form and rounds once: for every bfloat16 in [-8, 8]
    that is the float64 value correctly rounded. (The float64 reference is the sigmoid form too: the tanh
    form's ``1 + tanh(z)`` cancels for negative x, even in float64.)"""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = every[every.float().abs() <= 8].clone().requires_grad_()
    k, a = math.sqrt(2 / math.pi), 0.044715
    x64 = x.detach().double()
    exact = (x64 * torch.sigmoid(2 * k * (x64 + a * x64**3))).to(torch.bfloat16)
    y = gelu_new(x)
    assert y.dtype == torch.bfloat16 and x.numel() > 30000
    assert torch.equal(y.detach(), exact)
    seed = torch.randn(x.shape).to(torch.bfloat16)
    (ours,) = torch.autograd.grad(y, x, seed)
    (aten,) = torch.autograd.grad(F.gelu(x, approximate="tanh"), x, seed)
    assert torch.equal(ours, aten)  # ATen's bfloat16 gelu_backward, as F.gelu's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_gelu_new_in_chunks_is_the_whole_tensor_formula_bit_for_bit(monkeypatch, dtype):
    """A tensor of several chunks (the last one partial, the input not contiguous) gets the same values as the
    sigmoid form over the whole tensor at once, and the same gradient. (A chunk is a multiple of any vector
    width, as the real one is: ATen's scalar loop, which takes an odd tail, can differ from its vector loop in
    the last bit of float32.)"""
    import ipuft_decoder.block as block

    monkeypatch.setattr(block, "GELU_CHUNK", 1024)
    x = (torch.randn(37, 130) * 4).to(dtype).t().requires_grad_()  # 4810 elements: 4 whole chunks and a part
    k, a = math.sqrt(2 / math.pi), 0.044715
    x32 = x.detach().float().contiguous()
    whole = torch.addcmul(torch.tensor(2 * k), x32, x32, value=2 * k * a).mul_(x32).sigmoid_().mul_(x32).to(dtype)
    y = gelu_new(x)
    assert y.dtype == dtype and y.is_contiguous() and torch.equal(y.detach(), whole)
    seed = torch.randn(x.shape).to(dtype)
    (ours,) = torch.autograd.grad(y, x, seed)
    (aten,) = torch.autograd.grad(F.gelu(x, approximate="tanh"), x, seed)
    assert torch.equal(ours, aten)


def test_bfloat16_block_on_the_cpu_tracks_a_float64_reference():
    """With its attention computed in float32 and rounded once, the bfloat16 block (output and every
    gradient) stays within a few bfloat16 roundings of the same block in float64: each of the block's
    roughly ten rounded intermediates is off by at most 2^-9 relative, so 8·2^-8 of the largest value bounds
    the sum of them with room; a wrong mask, dtype or transpose would be off by the size of the values."""
    block, weights = _block_and_weights()
    x = torch.randn(2, 6, 32).to(torch.bfloat16)
    seed = torch.randn(2, 6, 32).to(torch.bfloat16)
    results = {}
    for dtype in (torch.bfloat16, torch.float64):
        leaves = {n: w.to(torch.bfloat16).to(dtype).requires_grad_() for n, w in weights.items()}
        inp = x.to(dtype).detach().requires_grad_()
        out = functional_call(block.to(dtype), leaves, (inp,))
        out.backward(seed.to(dtype))
        results[dtype] = {"out": out.detach(), "x": inp.grad, **{n: w.grad for n, w in leaves.items()}}
    for name, ours in results[torch.bfloat16].items():
        expected = results[torch.float64][name]
        assert ours.dtype == torch.bfloat16, name
        assert (ours.double() - expected).abs().max() <= 8 * 2**-8 * expected.abs().max(), name
