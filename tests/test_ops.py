"""ipuft.ops: the projections whose weight gradients the engine takes over several micro-batches at once."""

import pytest
import torch
import torch.nn.functional as F

from ipuft.components import recompute
from ipuft.ops import Embedding, Linear, WeightGradients, linear, output_projection, taking_weight_gradients


def _block(dtype):
    """Two projections in a row, the second an output projection: ``out(gelu(proj(x)))``."""
    torch.manual_seed(0)
    proj, out = Linear(16, 48).to(dtype), Linear(48, 16, bias=False).to(dtype)
    return proj, out, [torch.randn(3, 5, 16, dtype=dtype) for _ in range(4)], [torch.randn(3, 5, 16, dtype=dtype)
                                                                                  for _ in range(4)]


def _run(proj, out, xs, seeds, leaves, taken, recomputing):
    """Every micro-batch's backward with ``leaves`` bound as the weights; the inputs' gradients."""
    grads_x = []
    for value, seed in zip(xs, seeds, strict=True):
        x = value.detach().requires_grad_()
        with taking_weight_gradients(taken):
            with recompute() if recomputing else torch.enable_grad():
                y = output_projection(leaves["out"], F.gelu(linear(x, leaves["w"], leaves["b"])))
            torch.autograd.backward(y, seed, inputs=[x, *leaves.values()])
        grads_x.append(x.grad)
    return grads_x


@pytest.mark.parametrize("recomputing", [False, True])
def test_taken_gradients_equal_autograds_sum_over_micro_batches(recomputing):
    """float32: the taken weight and bias gradients equal autograd's summed over the micro-batches (to float32
    summation order), and the inputs' gradients are autograd's exactly."""
    proj, out, xs, seeds = _block(torch.float32)
    plain = {"w": proj.weight.detach().requires_grad_(), "b": proj.bias.detach().requires_grad_(),
             "out": out.weight.detach().requires_grad_()}
    expected_x = _run(proj, out, xs, seeds, plain, None, recomputing)
    leaves = {k: t.detach().requires_grad_() for k, t in plain.items()}
    taken = WeightGradients(leaves.values())
    got_x = _run(proj, out, xs, seeds, leaves, taken, recomputing)
    assert all(p.grad is None for p in leaves.values())  # nothing reached autograd's leaves
    assert sum(t.numel() for t in taken.held()) == 4 * 15 * (16 + 48 + 48 + 16)  # (x, g) of both, 4 micro-batches
    assert all(t.grad_fn is None for t in taken.held())  # no kept input keeps the graph that made it
    got = {id(leaf): g for leaf, g in taken.take()}
    assert not taken.held() and not list(taken.take())  # let go, and nothing taken twice
    for name, leaf in leaves.items():
        torch.testing.assert_close(got[id(leaf)], plain[name].grad, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_x, expected_x, strict=True):
        assert torch.equal(a, b)


def test_a_16_bit_take_is_one_product_over_every_token():
    """bfloat16: a take is the weight gradient of all the micro-batches as one batch, bit for bit (one float32
    accumulation, one rounding), not the sum of per-micro-batch gradients each rounded to 16 bits."""
    proj, out, xs, seeds = _block(torch.bfloat16)
    leaves = {"w": proj.weight.detach().requires_grad_(), "b": proj.bias.detach().requires_grad_(),
              "out": out.weight.detach().requires_grad_()}
    taken = WeightGradients(leaves.values())
    _run(proj, out, xs, seeds, leaves, taken, True)
    got = {id(leaf): g for leaf, g in taken.take()}
    whole = {k: t.detach().requires_grad_() for k, t in leaves.items()}
    _run(proj, out, [torch.cat(xs)], [torch.cat(seeds)], whole, None, False)
    for name, leaf in leaves.items():
        assert got[id(leaf)].dtype == torch.bfloat16 and torch.equal(got[id(leaf)], whole[name].grad), name


def test_what_is_not_taken_is_autograds():
    """A weight the engine did not name (a frozen one, or one reached through another op, as under TP), a
    trainable weight beside a bias not named, and any use outside a take: plain ``F.linear``, autograd's
    gradients."""
    torch.manual_seed(0)
    w, b = torch.randn(8, 4, requires_grad=True), torch.randn(8, requires_grad=True)
    x = torch.randn(2, 4)
    taken = WeightGradients([w])  # the bias is trainable but not named
    with taking_weight_gradients(taken):
        linear(x, w, b).sum().backward()
        linear(x, w * 1.0).sum().backward()  # not the named leaf itself
    assert not taken.held()
    torch.testing.assert_close(w.grad, 2 * torch.ones(8, 2) @ x)
    torch.testing.assert_close(b.grad, torch.full((8,), 2.0))
    layer = Linear(4, 8)
    assert isinstance(layer, torch.nn.Linear)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize(("dtype", "head_dim", "positions", "kernels", "in_float32"), [
    (torch.bfloat16, 256, 256, True, False),  # GPT-J-6B's heads
    (torch.bfloat16, 128, 2048, True, False),  # Llama's
    (torch.bfloat16, 128, 128, True, True),  # too few positions
    (torch.bfloat16, 64, 1024, True, True),  # short heads
    (torch.bfloat16, 256, 256, False, True),  # no AVX-512 BF16 here
    (torch.float16, 256, 2048, True, True),  # no fast float16 kernel on the CPU
    (torch.float32, 256, 2048, True, False),  # already float32
])
def test_attention_in_float32_where_the_16_bit_kernel_is_slower(monkeypatch, dtype, head_dim, positions, kernels,
                                                               in_float32):
    from ipuft import ops

    monkeypatch.setattr(ops, "_bfloat16_attention_kernels", lambda: kernels)
    assert ops.attention_in_float32(torch.empty(1, dtype=dtype), head_dim, positions) is in_float32
    assert ops.attention_in_float32(torch.empty(1, dtype=dtype, device="meta"), head_dim, positions) is False


def _bfloat16_kernels() -> bool:
    from ipuft import ops

    return ops._bfloat16_attention_kernels()


@pytest.mark.skipif(not _bfloat16_kernels(), reason="needs ATen's bfloat16 CPU attention kernels (AVX-512 BF16)")
def test_a_bfloat16_block_with_long_heads_attends_in_bfloat16_as_accurately(monkeypatch):
    """A GPT-J block with heads of 128 over 256 positions attends in bfloat16 (GPT-J-6B's class of shapes), and
    its output and gradients are about as close to the float32 block's as those of the same bfloat16 block
    attending in float32: the 16-bit kernel adds no more than bfloat16's own rounding."""
    import copy

    from ipuft import attention, ops
    from ipuft_decoder import block as gptj

    torch.manual_seed(0)
    reference = gptj.GPTJDecoderBlock(256, 2, 128, 1024, 64)
    for p in reference.parameters():
        p.data.normal_(0, 0.05)
    x, seed = torch.randn(2, 256, 256), torch.randn(2, 256, 256)
    sdpa, seen = F.scaled_dot_product_attention, []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, *a, **k: seen.append(q.dtype) or sdpa(q, *a, **k))

    def run(dtype):
        module = copy.deepcopy(reference).to(dtype)
        inputs = x.to(dtype, copy=True).requires_grad_()
        out = module(inputs)
        out.backward(seed.to(dtype))
        return out.detach().float(), [inputs.grad.float(), *(p.grad.float() for p in module.parameters())]

    def errors(got, want):
        (out, grads), (exact, exact_grads) = got, want
        return float((out - exact).norm() / exact.norm()), max(float((g - e).norm() / e.norm())
                                                               for g, e in zip(grads, exact_grads, strict=True))

    exact = run(torch.float32)
    assert not ops.attention_in_float32(torch.empty(1, dtype=torch.bfloat16), 128, 256)
    seen.clear()
    in_bfloat16 = errors(run(torch.bfloat16), exact)
    assert seen == [torch.bfloat16]
    monkeypatch.setattr(attention, "attention_in_float32", lambda *args: True)
    seen.clear()
    in_float32 = errors(run(torch.bfloat16), exact)
    assert seen == [torch.float32]
    assert in_float32[0] < 2.0**-6 and in_float32[1] < 2.0**-4  # bfloat16 roundings (the worst gradient: a few %)
    assert in_bfloat16[0] <= 1.25 * in_float32[0] and in_bfloat16[1] <= 1.25 * in_float32[1], (in_bfloat16, in_float32)


def test_a_take_writes_into_the_memory_it_is_given_when_it_fits():
    torch.manual_seed(0)
    w, b = torch.randn(8, 4, requires_grad=True), torch.randn(8, requires_grad=True)
    x, g = torch.randn(6, 4), torch.randn(6, 8)
    homes = {id(w): torch.empty(8, 4), id(b): torch.empty(8, dtype=torch.float64)}  # the bias's does not fit
    taken = WeightGradients([w, b])
    taken.add(w, b, x, g)
    got = dict((id(leaf), grad) for leaf, grad in taken.take(lambda leaf: homes.get(id(leaf))))
    assert got[id(w)] is homes[id(w)] and torch.equal(got[id(w)], g.t() @ x)
    assert got[id(b)] is not homes[id(b)] and torch.equal(got[id(b)], g.sum(0))



def _lookups(dtype):
    """Four micro-batches of ids into a 40-row table (rows repeated within and across micro-batches, most of the
    table untouched) and their output gradients."""
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 12, (2, 7), generator=g) for _ in range(4)]
    seeds = [torch.randn(2, 7, 16, generator=g).to(dtype) for _ in range(4)]
    return ids, seeds


def _embedding_take(table, ids, seeds, into=None):
    """The gradient of ``table``'s weight taken over every micro-batch (nothing reaches autograd's ``.grad``)."""
    taken = WeightGradients([table.weight])
    with taking_weight_gradients(taken):
        for i, seed in zip(ids, seeds, strict=True):
            torch.autograd.backward(table(i), seed, inputs=[table.weight])
    assert table.weight.grad is None and (taken.held() or taken.accumulated())
    ((leaf, grad),) = list(taken.take(into))
    assert leaf is table.weight and not taken.held() and not taken.accumulated()
    # A 16-bit table's rows are summed in float32 over every micro-batch; the engine rounds the sum once
    # (ipuft.engine.gradients.GradientSum), as this does.
    return grad.to(leaf.dtype)


def test_an_embedding_take_is_autograds_gradient_of_every_lookup():
    """float32: the taken gradient of an embedding is autograd's for all the micro-batches as one batch, bit for
    bit; bfloat16: that gradient computed in float32 and rounded once (not each micro-batch's rounded, summed)."""
    torch.manual_seed(0)
    table = Embedding(40, 16)
    ids, seeds = _lookups(torch.float32)
    got = _embedding_take(table, ids, seeds)
    plain = table.weight.detach().requires_grad_()
    torch.autograd.backward(F.embedding(torch.cat(ids), plain), torch.cat(seeds))
    assert torch.equal(got, plain.grad) and got.dtype == torch.float32
    assert got[12:].count_nonzero() == 0  # untouched rows: zeros

    half = Embedding(40, 16).to(torch.bfloat16)
    ids, seeds = _lookups(torch.bfloat16)
    got = _embedding_take(half, ids, seeds)
    wide = half.weight.detach().float().requires_grad_()
    torch.autograd.backward(F.embedding(torch.cat(ids), wide), torch.cat(seeds).float())
    assert got.dtype == torch.bfloat16 and torch.equal(got, wide.grad.to(torch.bfloat16))
    per_micro_batch = sum(torch.zeros(40, 16).index_add_(0, i.view(-1), s.view(-1, 16).float()).to(torch.bfloat16)
                          .float() for i, s in zip(ids, seeds, strict=True))
    assert not torch.equal(got, per_micro_batch.to(torch.bfloat16))  # what the test tells apart


def test_an_embedding_take_writes_into_the_memory_it_is_given():
    torch.manual_seed(0)
    table = Embedding(40, 16)
    ids, seeds = _lookups(torch.float32)
    fresh = _embedding_take(table, ids, seeds)
    home = torch.full((40, 16), 7.0)  # last step's gradient: overwritten, its untouched rows zeroed
    got = _embedding_take(table, ids, seeds, into=lambda leaf: home)
    assert got.data_ptr() == home.data_ptr() and torch.equal(got, fresh)


def test_embeddings_with_options_take_nn_embeddings_own_path():
    """``padding_idx`` (and the other options) change the gradient: such a table is not taken."""
    table = Embedding(40, 16, padding_idx=0)
    taken = WeightGradients([table.weight])
    with taking_weight_gradients(taken):
        table(torch.tensor([[0, 3, 3]])).sum().backward()
    assert not taken.held() and table.weight.grad[0].count_nonzero() == 0 and table.weight.grad[3].eq(2).all()
