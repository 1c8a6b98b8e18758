"""Sliding-window attention and the attention's family options.

Through the engine, against transformers' own Mistral and Qwen2 (``max_window_layers``: full layers below it,
windowed ones from it) at a sequence longer than the window: logits, loss and every gradient, packed rows
(transformers given position_ids and a 4-D mask), the eval loss, and greedy generation past the window, whose
cache keeps a window's last W positions only, as the plan counts it. At the module level, against a plain
attention written here: the window in both kernels, packed and cached, the softmax scale, the logit soft-cap,
q/k norms per head and over the width, and a per-call rotary.
"""

import json
import math
from dataclasses import fields

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import run_cli as cli
from hf_reference import hf_state
from llama_reference import hf_model, tokenizer_json
from test_engine import max_rel

from ipuft.attention import (
    CausalSelfAttention,
    HalvesRotary,
    current_layer,
    decoder_layer,
    example_mask,
    examples_apart,
    inverse_frequencies,
    rotate_half,
)
from ipuft.components import IGNORE_INDEX
from ipuft.config import load_config
from ipuft.data.batch import Batch
from ipuft.engine.generation import generate
from ipuft.engine.inference import LayerMajor
from ipuft.generate import LayerKVCache
from ipuft.plan import measure
from ipuft.plan.estimate import inference_estimate
from ipuft.plan.measure import UnitCost, kv_cache_layers, unit_cost
from ipuft.run.runtime import build_engine, inference_engine

W, T = 5, 16  # a window shorter than a third of the sequence
# Mistral: every layer windowed; Qwen2: layer 0 full, layer 1 windowed.
KINDS = {"mistral": {"sliding_window": W},
         "qwen2": {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 1}}


def windowed_model(directory, kind: str, seed: int):
    """transformers' ``kind`` with :data:`KINDS`' window, its matrices scaled up so that a continuation depends
    on the context, saved as a checkpoint directory."""
    hf = hf_model(kind, seed, **KINDS[kind])
    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * (1.0 if "embed" in name else p.shape[1] ** -0.5))
    hf.save_pretrained(directory, safe_serialization=True)
    tokenizer_json(directory / "tokenizer.json")
    return hf, directory


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("windowed")
    return {kind: windowed_model(root / kind, kind, seed) for seed, kind in enumerate(KINDS)}


def config(hooks, src, *extra):
    return load_config(None, [f"model.hf_checkpoint={src}", f"model.sequence_length={T}", "model.precision=float32",
                              "execution.loss_scaling=1", "execution.micro_batch_size=3",
                              "training.global_batch_size=3", *extra], hooks.registrations.config_sections)


def shifted(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), IGNORE_INDEX)], dim=1)


def engine_step(cfg, hooks, ids, labels, positions=None):
    """One training step's loss and every gradient (under Hugging Face names) through the engine."""
    engine = build_engine(cfg, hooks)
    grads, taken = {}, engine.compute.gradients

    def keep(phase, *args, **kwargs):
        out = taken(phase, *args, **kwargs)
        grads[phase.unit] = {n: g.clone() for n, g in out.items()}
        return out

    engine.compute.gradients = keep
    batch = Batch(ids[None], labels[None], None if positions is None else positions[None])
    loss = engine.step(batch, 0.0).loss
    return loss, hf_state(engine.model.modules, cfg.model.layers, grads)


def hf_step(hf, ids, labels, positions=None, mask=None):
    """transformers' logits, mean token loss over ``labels`` (already shifted) and every gradient."""
    hf.zero_grad()
    logits = hf(ids, position_ids=positions, attention_mask=mask).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    return logits.detach(), loss.item(), {n: p.grad.clone() for n, p in hf.named_parameters()}


def assert_same_gradients(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name, g in theirs.items():
        torch.testing.assert_close(ours[name], g, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize(("kind", "extra"), [("mistral", ()), ("qwen2", ()), ("qwen2", ("execution.recompute=false", "execution.offload=false"))],
                         ids=["mistral", "qwen2", "qwen2-kept-graphs"])
def test_windowed_logits_loss_and_gradients_equal_transformers(hooks, models, kind, extra):
    """A sequence of 16 past a window of 5: the engine's loss and every gradient (forward and recompute, or
    kept graphs, each under its layer), and the runner's logits, are transformers'; attending over the whole
    past instead moves the logits by far more than the tolerance."""
    hf, src = models[kind]
    cfg = config(hooks, src, *extra)
    ids = torch.randint(0, 101, (3, T), generator=torch.Generator().manual_seed(1))
    logits, loss, grads = hf_step(hf, ids, shifted(ids))
    ours_loss, ours_grads = engine_step(cfg, hooks, ids, shifted(ids))
    assert abs(ours_loss - loss) <= 1e-6 * abs(loss)
    assert_same_gradients(ours_grads, grads)
    runner = LayerMajor(inference_engine(cfg, hooks))
    ours = runner.logits(ids)
    torch.testing.assert_close(ours, logits, atol=1e-5, rtol=0)
    causal = torch.zeros(3, 1, T, T).masked_fill(~window_band(T, T), float("-inf"))
    with torch.no_grad():  # transformers takes a 4-D mask as it is: here the whole causal past, on every layer
        full = hf(ids, attention_mask=causal if kind == "mistral" else dict.fromkeys(
            ("full_attention", "sliding_attention"), causal)).logits
    assert max_rel(full, logits) > 1e-2


def packed_rows(vocab: int):
    """Two rows of examples longer than the window, packed: ids, shifted labels (an example's last token
    predicts nothing), and positions."""
    g = torch.Generator().manual_seed(2)
    rows = []
    for lengths in ([7, 9], [6, 3, 7]):
        ids, labels, positions = [], [], []
        for n in lengths:
            e = torch.randint(3, vocab, (n,), generator=g)
            ids.append(e)
            labels.append(torch.cat([e[1:], torch.tensor([IGNORE_INDEX])]))
            positions.append(torch.arange(n))
        rows.append((torch.cat(ids), torch.cat(labels), torch.cat(positions)))
    return (torch.stack([r[k] for r in rows]) for k in range(3))


def window_band(t: int, window: int) -> torch.Tensor:
    i = torch.arange(t)
    return (i[:, None] - i >= 0) & (i[:, None] - i < window)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_windowed_rows_equal_transformers_given_positions_and_a_4d_mask(hooks, models, kind):
    """Packed examples longer than the window: the engine's loss and every gradient, and the eval pass's loss
    sum, are transformers' given each example's positions and a 4-D mask of its example AND its window (on its
    windowed layers; its full layers the example's causal mask alone)."""
    hf, src = models[kind]
    cfg = config(hooks, src, "execution.micro_batch_size=2", "training.global_batch_size=2")
    ids, labels, positions = packed_rows(101)
    apart = example_mask(positions)
    windowed = apart & window_band(T, W)

    def additive(mask):
        return torch.zeros(2, 1, T, T).masked_fill(~mask, float("-inf"))

    if kind == "mistral":
        mask = additive(windowed)
    else:  # transformers takes one 4-D mask per layer kind
        mask = {"full_attention": additive(apart), "sliding_attention": additive(windowed)}
    _logits, loss, grads = hf_step(hf, ids, labels, positions, mask)
    ours_loss, ours_grads = engine_step(cfg, hooks, ids, labels, positions)
    assert abs(ours_loss - loss) <= 1e-6 * abs(loss)
    assert_same_gradients(ours_grads, grads)
    runner = LayerMajor(inference_engine(cfg, hooks))
    total, count = runner.loss_sum(ids, labels, positions)
    assert count == int((labels != IGNORE_INDEX).sum())
    assert abs(float(total) / count - loss) <= 1e-6 * loss


def test_eval_loss_past_the_window_equals_transformers(capsys, models, tmp_path):
    """``ipuft eval`` over rows longer than the window."""
    hf, src = models["qwen2"]
    rows = torch.randint(0, 101, (5, T + 1), generator=torch.Generator().manual_seed(4))
    data = tmp_path / "tokens.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r.tolist()}) + "\n" for r in rows))
    code, out, err = cli(capsys, "eval", f"model.hf_checkpoint={src}", f"model.sequence_length={T}",
                         f"data.path={data}", "data.format=tokens", "execution.micro_batch_size=2",
                         "model.precision=float32", "--json")
    assert code == 0, err
    with torch.no_grad():
        logits = hf(rows[:, :-1]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()
    assert abs(json.loads(out)["loss"] - expected) <= 1e-5 * expected


PROMPTS = [[5, 17, 99, 3], [11, 2, 7, 7, 9, 64, 12, 90], [42]]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_past_the_window_equals_transformers(hooks, models, kind):
    """Prompts of 4, 8 and 1 tokens, left-padded in one batch, continued by 12 greedy tokens (past the
    window of 5 from the prompt and again while decoding): each row is transformers' generate of its prompt
    alone; a windowed layer's cache then holds its last 5 positions, a full layer's all 19."""
    hf, src = models[kind]
    cfg = config(hooks, src)
    runner = LayerMajor(inference_engine(cfg, hooks))
    caches = []
    release = runner.release
    runner.release = lambda cache: (caches.append(cache), release(cache))
    ours = generate(runner, PROMPTS, 12)
    with torch.no_grad():
        for prompt, row in zip(PROMPTS, ours):
            ids = torch.tensor([prompt])
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            assert row == theirs[0, len(prompt):].tolist()
    assert len({tuple(r) for r in ours}) == 3 and all(len(set(r)) > 2 for r in ours)
    (cache,) = caches
    windowed = [W] * 2 if kind == "mistral" else [None, W]
    assert [layer.window for layer in cache.layers] == windowed
    # The last step read 8 + 11 positions; each windowed layer kept the last 5.
    assert [layer.kept for layer in cache.layers] == [19 if w is None else W for w in windowed]
    assert [layer.length for layer in cache.layers] == [19, 19]


@pytest.mark.parametrize("activation_offload", [False, True])
def test_the_plan_counts_a_windowed_cache_and_measures_each_layer_kind(hooks, models, activation_offload):
    """The inference view's device peak equals the runner's ledger when generating past the window (a
    windowed layer's cache at its last W positions); the plan reads each layer's window; the decoder's
    measured cost is the costlier kind's figure by figure (the window's saved mask against the full layer's
    causal kernel)."""
    _hf, src = models["qwen2"]
    cfg = config(hooks, src, "execution.offload=true", f"execution.activation_offload={str(activation_offload).lower()}")
    runner = LayerMajor(inference_engine(cfg, hooks))
    prompts = [[(7 * r + i) % 50 + 3 for i in range(8)] for r in range(3)]
    runner.store.reset_peak()
    assert all(len(row) == 9 for row in generate(runner, prompts, 9))
    parts = runner.model.parts
    planned = inference_estimate(cfg, parts, batch_size=3, prompt_tokens=8, new_tokens=9)
    assert planned["device_peak_bytes"] == runner.store.device_peak
    per_position = 2 * 2 * 8 * 4  # keys and values, 2 heads of 8, float32
    assert kv_cache_layers(parts, cfg) == [(per_position, None), (per_position, W)]
    assert planned["kv_cache_bytes"] == 3 * (16 + W) * per_position
    full, windowed = (measure._layer_cost(parts, "decoder", cfg, torch.device("cpu"), n) for n in (0, 1))
    assert windowed.saved_bytes >= full.saved_bytes + T * T  # the window's bool mask, which sdpa saves
    assert unit_cost(parts, "decoder", cfg) == UnitCost(*(max(getattr(full, f.name), getattr(windowed, f.name))
                                                          for f in fields(UnitCost)))


# ---- the module, against a plain attention ----


class RMS(torch.nn.Module):
    def __init__(self, width: int, seed: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.3 * torch.randn(width, generator=torch.Generator().manual_seed(seed)))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def plain_attention(a: CausalSelfAttention, h, *, window=None, positions=None, base=10000.0, scale=None,
                    softcap=None):
    """The attention written out: projections, the norms, rotate-half rotary at each token's position, every
    query against every key head it reads, the scaled (soft-capped) scores under the causal, window and example
    masks, softmax, values, output projection (without its bias, which the block adds after TP's sum)."""
    b, t, _ = h.shape
    d, heads, kv = a.head_dim, a.heads, a.kv_heads
    q, k, v = a.q_proj(h), a.k_proj(h), a.v_proj(h)
    if a.qk_norm_width:
        q, k = a.q_norm(q), a.k_norm(k)
    q, k, v = q.view(b, t, heads, d), k.view(b, t, kv, d), v.view(b, t, kv, d)
    if a.q_norm is not None and not a.qk_norm_width:
        q, k = a.q_norm(q), a.k_norm(k)
    pos = torch.arange(t).expand(b, t) if positions is None else positions
    angles = pos[..., None].float() * inverse_frequencies(d, base)
    cos, sin = torch.cat([angles, angles], -1).cos()[:, :, None], torch.cat([angles, angles], -1).sin()[:, :, None]
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = k.repeat_interleave(heads // kv, dim=2), v.repeat_interleave(heads // kv, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * (d**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(t)
    allowed = (i[None, :] <= i[:, None]).expand(b, t, t)
    if window is not None:
        allowed = allowed & (i[None, :] > i[:, None] - window)
    if positions is not None:
        allowed = allowed & (i[None, :] >= (i - positions)[:, :, None])
    probs = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    return F.linear(torch.einsum("bhij,bjhd->bihd", probs, v).flatten(-2), a.o_proj.weight)  # its bias: the block's


def module(kernel="sdpa", norms=None, **options) -> CausalSelfAttention:
    """6 query heads of 8 over 2 key/value heads, biases, every weight random."""
    q_norm = k_norm = None
    if norms == "head":
        q_norm, k_norm = RMS(8, 1), RMS(8, 2)
    elif norms == "width":
        q_norm, k_norm = RMS(48, 1), RMS(16, 2)
    torch.manual_seed(0)
    a = CausalSelfAttention(40, 6, 8, HalvesRotary(8, 8), kv_heads=2, qkv_bias=True, output_bias=True,
                            kernel=kernel, q_norm=q_norm, k_norm=k_norm, qk_norm_width=norms == "width", **options)
    with torch.no_grad():
        for name, p in a.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)
    return a


H = torch.randn(2, T, 40, generator=torch.Generator().manual_seed(3))
POSITIONS = torch.cat([torch.arange(7), torch.arange(9)]).expand(2, T).clone()
POSITIONS[1] = torch.cat([torch.arange(3), torch.arange(13)])


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("window", [None, W, T])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_the_window_in_either_kernel_is_the_plain_attention(kernel, window, packed):
    """A window of 5 in 16 positions, or one as long as the sequence (the causal mask itself), plain rows and
    packed ones (the window AND the example), in training (gradients too) and eval."""
    a = module(kernel)
    positions = POSITIONS if packed else None
    h = H.clone().requires_grad_()
    with examples_apart(positions):
        ours = a(h, window=window)
    expected = plain_attention(a, H, window=window, positions=positions).detach()
    assert max_rel(ours.detach(), expected) <= 1e-5
    (grad,) = torch.autograd.grad(ours.square().sum(), h)
    ref = H.clone().requires_grad_()
    (expected_grad,) = torch.autograd.grad(plain_attention(a, ref, window=window, positions=positions).square().sum(),
                                           ref)
    assert max_rel(grad, expected_grad) <= 1e-5
    if window == W:
        assert max_rel(ours.detach(), plain_attention(a, H, positions=positions).detach()) > 1e-2


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("chunks", [[16], [3, 1, 1, 6, 1, 1, 1, 1, 1], [1] * 16], ids=["prefill", "chunks", "decode"])
def test_a_windowed_cache_keeps_the_last_w_and_attends_as_the_whole_sequence(kernel, chunks):
    """The sequence fed to a cache in pieces (a prompt past the window, pieces longer than it, one token at a
    time) gives the uncached windowed attention's outputs; the cache never holds more than 5 positions; rows
    left-padded by 0 and 3 tokens see only their own tokens, within their window."""
    a = module(kernel).eval()
    expected = plain_attention(a, H, window=W)
    cache, outs, start = LayerKVCache(), [], 0
    with torch.no_grad():
        for n in chunks:
            outs.append(a(H[:, start : start + n], cache, window=W))
            start += n
            assert cache.kept <= W and cache.length == start and cache.nbytes == 2 * 2 * 2 * cache.kept * 8 * 4
    assert max_rel(torch.cat(outs, 1), expected) <= 1e-5
    # Left padding: row 1's first 3 tokens are pads; its real tokens attend as a row of 13 alone.
    padded = torch.cat([torch.zeros(1, 3, 40), H[1:, :13]], 1)
    cache, outs, start = LayerKVCache(torch.tensor([0, 3])), [], 0
    with torch.no_grad():
        for n in chunks:
            outs.append(a(torch.cat([H[:1], padded])[:, start : start + n], cache, window=W))
            start += n
    out = torch.cat(outs, 1)
    assert max_rel(out[0], expected[0]) <= 1e-5
    assert max_rel(out[1, 3:], plain_attention(a, H[1:, :13], window=W)[0]) <= 1e-5


@pytest.mark.parametrize("norms", [None, "head", "width"])
@pytest.mark.parametrize(("scale", "softcap"), [(None, None), (0.2, None), (None, 0.7), (0.2, 0.7)])
def test_scale_softcap_and_qk_norms_are_the_plain_attention(norms, scale, softcap):
    """The softmax scale, the logit soft-cap (scores ``cap · tanh(scores / cap)``, a cap small enough to bend
    them; the eager kernel), and RMSNorms of q and k before rotary, per head or over the projected width, each
    named ``q_norm`` / ``k_norm``; with a window, packed, and in a cache too."""
    a = module(norms=norms, scale=scale, logit_softcap=softcap)
    assert a.kernel == ("eager" if softcap is not None else "sdpa")
    if norms is not None:
        assert {"q_norm.weight", "k_norm.weight"} <= set(dict(a.named_parameters()))
    options = {"scale": scale, "softcap": softcap}
    assert max_rel(a(H), plain_attention(a, H, **options)) <= 1e-5
    with examples_apart(POSITIONS):
        ours = a(H, window=W)
    assert max_rel(ours, plain_attention(a, H, window=W, positions=POSITIONS, **options)) <= 1e-5
    with torch.no_grad():
        cache = LayerKVCache()
        cached = torch.cat([a(H[:, :9], cache, window=W), a(H[:, 9:], cache, window=W)], 1)
    assert max_rel(cached, plain_attention(a, H, window=W, **options)) <= 1e-5
    if (scale, softcap, norms) != (None, None, None):
        assert max_rel(a(H), plain_attention(module(), H)) > 1e-2  # each option changes the arithmetic


def test_a_per_call_rotary_and_the_layer_context():
    """``rotary=`` turns by another base for one call, each rotary's tables cached apart; ``current_layer``
    is what the innermost ``decoder_layer`` set; a q/k norm over the width is refused under TP."""
    a, local = module(), HalvesRotary(8, 8, 500.0)
    assert max_rel(a(H, rotary=local), plain_attention(a, H, base=500.0)) <= 1e-5
    assert max_rel(a(H), plain_attention(a, H)) <= 1e-5
    assert {entry[0] for entry in a._tables.values()} == {a.rotary, local}
    assert current_layer() is None
    with decoder_layer(3):
        assert current_layer() == 3
        with decoder_layer(None):
            assert current_layer() is None
        assert current_layer() == 3
    assert current_layer() is None
    with pytest.raises(ValueError, match="over the whole projected width"):
        CausalSelfAttention(40, 6, 8, HalvesRotary(8, 8), kv_heads=2, tensor_parallel=2, q_norm=RMS(24, 1),
                            k_norm=RMS(8, 2), qk_norm_width=True)
    assert math.isclose(module(scale=0.25).scale, 0.25)
