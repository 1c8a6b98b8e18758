"""Generation with a KV cache: the cache changes nothing but speed, and greedy decoding is transformers'."""

import pytest
import torch
from hf_reference import hf_gptj

from ipuft.generate import KVCache, forward_logits, generate
from ipuft.hf import from_hf
from ipuft.model import build_model

PROMPTS = [[5, 17, 99, 3], [1], [100, 2, 7, 7, 7, 64, 12, 90, 3, 44]]


def tiny_model(make_config, hooks, *overrides):
    """A tiny transformers GPT-J and the same weights as ipuft units.

    hf_gptj's default init gives logits dominated by the head's bias (every prompt continues with the same
    token); larger matrices make the continuations depend on the context.
    """
    cfg = make_config("model.sequence_length=32", *overrides)
    hf = hf_gptj(cfg)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                std = 1.0 if "wte" in name else p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    parts = build_model(cfg, hooks)
    weights = from_hf(parts.modules, cfg.model.layers, hf.state_dict())
    return cfg, hf, parts, weights


@pytest.fixture
def model(make_config, hooks):
    return tiny_model(make_config, hooks)


def run(model, prompt, new, **kwargs):
    cfg, _, parts, weights = model
    return generate(parts.modules, weights, cfg.model.layers, prompt, new, **kwargs)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_with_cache_equals_full_recompute(model, prompt):
    cached = run(model, prompt, 20)
    assert cached == run(model, prompt, 20, use_cache=False)
    assert len(cached) == 20 and len(set(cached)) > 1  # a continuation that depends on something


@pytest.mark.parametrize("prompt", PROMPTS)
def test_sampling_with_cache_equals_full_recompute(model, prompt):
    def sample(use_cache):
        return run(model, prompt, 20, temperature=0.8, top_k=20, top_p=0.9, use_cache=use_cache,
                   generator=torch.Generator().manual_seed(3))

    assert sample(True) == sample(False)


def test_sampling_is_reproducible_and_seeded(model):
    def sample(seed):
        return run(model, PROMPTS[0], 20, temperature=1.0, generator=torch.Generator().manual_seed(seed))

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    assert sample(1) != run(model, PROMPTS[0], 20)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_transformers_generate(model, prompt):
    _, hf, _, _ = model
    hf.generation_config.eos_token_id = None  # hf_gptj's eos is token 0: do not stop early
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=20, use_cache=True, pad_token_id=0)
    assert run(model, prompt, 20) == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("chunks", [(5, 1, 1, 1), (3, 3, 2)], ids=["prefill5+1+1+1", "chunks3+3+2"])
def test_cached_logits_equal_full_sequence_logits(make_config, hooks, kernel, chunks):
    cfg, _, parts, weights = tiny_model(make_config, hooks, f"plugins.gptj_decoder.attention_kernel={kernel}")
    layers = cfg.model.layers
    ids = torch.randint(0, cfg.model.embedding.vocab_size, (1, sum(chunks)), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = forward_logits(parts.modules, weights, layers, ids)
        cache = KVCache(layers)
        start = 0
        for size in chunks:
            step = forward_logits(parts.modules, weights, layers, ids[:, start : start + size], cache)
            assert cache.length == start + size
            torch.testing.assert_close(step, full[:, start : start + size], atol=1e-5, rtol=0)
            start += size
    assert cache[0].keys.shape == (1, cfg.model.attention.heads, sum(chunks),
                                   cfg.model.hidden_size // cfg.model.attention.heads)


def test_eos_stops_generation_and_is_included(model):
    prompt = PROMPTS[2]
    greedy = run(model, prompt, 20)
    assert run(model, prompt, 20, eos_id=greedy[0]) == [greedy[0]]
    later = next(t for t in greedy if t != greedy[0])
    stop = greedy.index(later)
    assert run(model, prompt, 20, eos_id=later) == greedy[: stop + 1]
    assert run(model, prompt, 20, eos_id=later, use_cache=False) == greedy[: stop + 1]


def test_top_k_1_sampling_equals_greedy(model):
    for prompt in PROMPTS:
        sampled = run(model, prompt, 12, temperature=1.5, top_k=1, generator=torch.Generator().manual_seed(0))
        assert sampled == run(model, prompt, 12)


def test_tiny_top_p_keeps_only_the_top_token(model):
    for prompt in PROMPTS:
        sampled = run(model, prompt, 12, temperature=1.0, top_p=1e-6, generator=torch.Generator().manual_seed(0))
        assert sampled == run(model, prompt, 12)


@pytest.mark.parametrize("new", [0, 1, 7])
def test_max_new_tokens_is_respected(model, new):
    assert len(run(model, PROMPTS[0], new)) == new
    assert len(run(model, PROMPTS[0], new, temperature=1.0, generator=torch.Generator().manual_seed(0))) == new


def test_dropout_is_off_while_generating_and_training_flags_are_restored(make_config, hooks):
    cfg, _, parts, weights = tiny_model(make_config, hooks, "model.dropout_prob=0.5")
    for module in parts.modules.values():
        module.train()
    first = generate(parts.modules, weights, cfg.model.layers, PROMPTS[0], 10)
    assert first == generate(parts.modules, weights, cfg.model.layers, PROMPTS[0], 10, use_cache=False)
    assert all(m.training for module in parts.modules.values() for m in module.modules())


def test_empty_prompt_is_refused(model):
    with pytest.raises(ValueError, match="prompt"):
        run(model, [], 3)
