"""Core's one causal attention (``ipuft.attention``) on its own: the two rotations, partial rotary on halves,
and the kernels; the families' parity with transformers is in test_parity_hf.py and test_llama.py."""

import pytest
import torch

from ipuft.attention import CausalSelfAttention, HalvesRotary, InterleavedRotary
from ipuft.generate import LayerKVCache


def test_partial_rotary_on_halves_turns_only_the_first_rotary_dims():
    """Dimension i < rotary_dim / 2 pairs with i + rotary_dim / 2 and turns by p·base^(-2i/rotary_dim); the
    dimensions past rotary_dim pass unchanged (GPT-NeoX's partial rotary)."""
    rotary = HalvesRotary(head_dim=8, rotary_dim=4, base=10000.0)
    x = torch.randn(2, 5, 3, 8)  # [B, T, heads, head_dim]
    rotated = rotary.rotate(x, rotary.span(rotary.table(5, torch.device("cpu")), 0, 5))
    assert rotated.shape == (2, 3, 5, 8)
    x = x.transpose(1, 2)
    assert torch.equal(rotated[..., 4:], x[..., 4:])
    assert torch.equal(rotated[:, :, 0], x[:, :, 0])  # position 0 turns by angle 0
    p, i = 3, 1
    angle = torch.tensor(p * 10000.0 ** (-2 * i / 4))
    a, b = x[:, :, p, i], x[:, :, p, i + 2]
    torch.testing.assert_close(rotated[:, :, p, i], a * angle.cos() - b * angle.sin(), rtol=0, atol=1e-6)
    torch.testing.assert_close(rotated[:, :, p, i + 2], a * angle.sin() + b * angle.cos(), rtol=0, atol=1e-6)


def _pairs_to_halves(rotary_dim: int, head_dim: int) -> torch.Tensor:
    """The permutation of a head's dimensions that takes interleaved pairs (2i, 2i+1) to halves (i, i + d/2)."""
    turned = [2 * i for i in range(rotary_dim // 2)] + [2 * i + 1 for i in range(rotary_dim // 2)]
    return torch.tensor(turned + list(range(rotary_dim, head_dim)))


@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_interleaved_and_halves_are_one_rotation_up_to_the_order_of_a_heads_dimensions(rotary_dim):
    """GPT-J's attention with q and k's output rows permuted, head by head, from pairs to halves is the
    rotate-half attention: the same output (within float32 rounding), in training and from a cache."""
    torch.manual_seed(0)
    heads, head_dim = 4, 8
    interleaved = CausalSelfAttention(32, heads, head_dim, InterleavedRotary(head_dim, rotary_dim))
    halves = CausalSelfAttention(32, heads, head_dim, HalvesRotary(head_dim, rotary_dim))
    order = torch.cat([h * head_dim + _pairs_to_halves(rotary_dim, head_dim) for h in range(heads)])
    with torch.no_grad():
        for name in ("q_proj", "k_proj"):
            getattr(halves, name).weight.copy_(getattr(interleaved, name).weight[order])
        halves.v_proj.weight.copy_(interleaved.v_proj.weight)
        halves.o_proj.weight.copy_(interleaved.o_proj.weight)
    x = torch.randn(2, 7, 32)
    torch.testing.assert_close(halves(x), interleaved(x), rtol=0, atol=1e-5)
    caches = LayerKVCache(torch.tensor([0, 2])), LayerKVCache(torch.tensor([0, 2]))
    with torch.no_grad():
        for start, new in ((0, 5), (5, 1), (6, 1)):
            a, b = (m(x[:, start:start + new], c) for m, c in zip((halves, interleaved), caches, strict=True))
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_the_eager_kernel_attends_as_sdpa_does_with_grouped_query_heads_and_a_cache():
    torch.manual_seed(0)
    rotary = HalvesRotary(8, 8)
    sdpa = CausalSelfAttention(32, 4, 8, rotary, kv_heads=2, qkv_bias=True, output_bias=True)
    eager = CausalSelfAttention(32, 4, 8, rotary, kv_heads=2, qkv_bias=True, output_bias=True, kernel="eager")
    eager.load_state_dict(sdpa.state_dict())
    assert sdpa.k_proj.weight.shape == (16, 32) and sdpa.o_proj.bias.shape == (32,)
    x = torch.randn(3, 6, 32)
    torch.testing.assert_close(eager(x), sdpa(x), rtol=0, atol=1e-6)
    caches = LayerKVCache(torch.tensor([1, 0, 3])), LayerKVCache(torch.tensor([1, 0, 3]))
    with torch.no_grad():
        for start, new in ((0, 4), (4, 1), (5, 1)):
            a, b = (m(x[:, start:start + new], c) for m, c in zip((eager, sdpa), caches, strict=True))
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert caches[0].keys.shape == (3, 2, 6, 8)  # the cache is kv_heads wide


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="attention kernel 'flash': one of sdpa, eager"):
        CausalSelfAttention(32, 4, 8, HalvesRotary(8, 8), kernel="flash")
