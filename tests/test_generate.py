"""Generation through the layer-major runner: the cache changes nothing but speed, a batch of prompts of
different lengths decodes exactly as each prompt alone, greedy decoding is transformers', and the device
holds one unit plus buffers however deep the model is."""

import pytest
import torch
from hf_reference import hf_gptj, hf_runner

from ipuft.engine.generation import generate
from ipuft.generate import KVCache

PROMPTS = [[5, 17, 99, 3], [1], [100, 2, 7, 7, 7, 64, 12, 90, 3, 44]]


def tiny_model(make_config, hooks, *overrides):
    """A tiny transformers GPT-J, and a runner whose engine holds the same weights.

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
    return cfg, hf, hf_runner(cfg, hooks, hf.state_dict())


@pytest.fixture
def model(make_config, hooks):
    return tiny_model(make_config, hooks)


def run(model, prompt, new, **kwargs):
    """The new tokens of one prompt, decoded alone."""
    return generate(model[2], [prompt], new, **kwargs)[0]


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
    _, hf, _ = model
    hf.generation_config.eos_token_id = None  # hf_gptj's eos is token 0: do not stop early
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=20, use_cache=True, pad_token_id=0)
    assert run(model, prompt, 20) == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_a_batch_of_different_lengths_equals_each_prompt_alone_and_transformers(make_config, hooks, kernel):
    """Left padding with per-row positions and masked pad keys: the batch decodes token for token as each
    prompt does alone, and as transformers' greedy generate does."""
    model = tiny_model(make_config, hooks, f"plugins.gptj_decoder.attention_kernel={kernel}")
    _, hf, runner = model
    prompts = [*PROMPTS, [9, 9, 9, 9, 9, 9, 9]]
    batched = generate(runner, prompts, 16)
    hf.generation_config.eos_token_id = None
    for prompt, tokens in zip(prompts, batched, strict=True):
        assert tokens == run(model, prompt, 16)
        theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=16, pad_token_id=0)
        assert tokens == theirs[0, len(prompt):].tolist()
    # The same prompts in another order and batch split: the same continuations.
    assert generate(runner, prompts[::-1], 16) == batched[::-1]
    assert generate(runner, prompts[:2], 16) + generate(runner, prompts[2:], 16) == batched


def test_rows_stop_at_their_own_eos_while_the_others_go_on(model):
    alone = [run(model, p, 12) for p in PROMPTS]
    eos = alone[0][3]  # the first row emits it at its fourth token
    batched = generate(model[2], PROMPTS, 12, eos_id=eos)
    for tokens, full in zip(batched, alone):
        assert tokens == (full[: full.index(eos) + 1] if eos in full else full)
    assert len(batched[0]) == 4


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("chunks", [(5, 1, 1, 1), (3, 3, 2)], ids=["prefill5+1+1+1", "chunks3+3+2"])
def test_cached_logits_equal_full_sequence_logits(make_config, hooks, kernel, chunks):
    cfg, _, runner = tiny_model(make_config, hooks, f"plugins.gptj_decoder.attention_kernel={kernel}")
    layers = cfg.model.layers
    ids = torch.randint(0, cfg.model.embedding.vocab_size, (1, sum(chunks)), generator=torch.Generator().manual_seed(1))
    full = runner.logits(ids)
    cache = KVCache(layers)
    start = 0
    for size in chunks:
        step = runner.logits(ids[:, start : start + size], cache)
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
    _, _, runner = tiny_model(make_config, hooks, "model.dropout_prob=0.5")
    modules = runner.model.modules
    for module in modules.values():
        module.train()
    first = generate(runner, [PROMPTS[0]], 10)
    assert first == generate(runner, [PROMPTS[0]], 10, use_cache=False)
    assert all(m.training for module in modules.values() for m in module.modules())


def test_empty_prompt_is_refused(model):
    with pytest.raises(ValueError, match="prompt"):
        run(model, [], 3)


def unit_bytes(runner) -> int:
    """The largest unit's weights, as the device holds them while the unit runs."""
    return max(sum(t.numel() * t.element_size() for t in group["fwd"].values())
               for group in runner.store.entries.values())


@pytest.mark.parametrize("activation_offload", [True, False])
def test_device_holds_one_unit_plus_buffers_however_deep(make_config, hooks, activation_offload):
    """Weights offloaded: the device peak is the largest unit plus the batch's buffers. With the KV cache
    offloaded too (activation_offload), a model eight times deeper does not raise the peak at all; with
    the cache on the device, it grows by exactly the deeper model's extra cache."""
    peaks, caches = {}, {}
    for layers in (2, 16):
        cfg, _, runner = tiny_model(make_config, hooks, f"model.layers={layers}", "execution.offload=true",
                                    f"execution.activation_offload={str(activation_offload).lower()}")
        runner.store.reset_peak()
        prompts = [p * 2 for p in PROMPTS]
        generate(runner, prompts, 8)
        peaks[layers] = runner.store.device_peak
        assert runner.store.device_resident == 0  # everything the passes brought is gone again
        batch, width = len(prompts), max(len(p) for p in prompts) + 8
        h = cfg.model.hidden_size
        caches[layers] = 2 * layers * batch * width * h * 4  # keys and values of every layer, float32
        # The largest unit (the head), the hidden states in and out, the logits of the last positions, and
        # the KV cache: one layer's with offload, every layer's without.
        buffers = 3 * batch * width * h * 4 + batch * cfg.model.embedding.vocab_size * 4
        cache = caches[layers] // layers if activation_offload else caches[layers]
        assert unit_bytes(runner) <= peaks[layers] <= unit_bytes(runner) + buffers + cache
    if activation_offload:
        assert peaks[16] == peaks[2]
    else:
        assert peaks[16] - peaks[2] <= caches[16] - caches[2]
        assert peaks[16] > peaks[2]


@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("activation_offload", [True, False])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_plan_inference_view_equals_the_measured_device_peak(make_config, hooks, offload, activation_offload,
                                                              precision):
    from ipuft.plan.estimate import inference_estimate

    cfg, _, runner = tiny_model(make_config, hooks, "model.layers=3", f"execution.offload={str(offload).lower()}",
                                f"execution.activation_offload={str(activation_offload).lower()}",
                                f"model.precision={precision}")
    prompts = [[(7 * r + i) % 50 + 1 for i in range(6)] for r in range(5)]
    runner.store.reset_peak()
    out = generate(runner, prompts, 9)
    assert all(len(tokens) == 9 for tokens in out)
    planned = inference_estimate(cfg, runner.model.parts, batch_size=5, prompt_tokens=6, new_tokens=9)
    assert planned["device_peak_bytes"] == runner.store.device_peak


@pytest.mark.parametrize("activation_offload", [True, False])
def test_eval_loss_and_scoring_do_not_grow_with_depth(make_config, hooks, activation_offload):
    """The loss pass and MNLI scoring keep one batch of hidden states between units (no cache), so their
    device peak is the same for 2 and 16 layers, with or without activation offload."""
    from ipuft.components import IGNORE_INDEX
    from ipuft.run.evaluate import label_log_likelihoods

    peaks = {}
    for layers in (2, 16):
        _, _, runner = tiny_model(make_config, hooks, f"model.layers={layers}", "execution.offload=true",
                                  f"execution.activation_offload={str(activation_offload).lower()}")
        ids = torch.randint(1, 100, (4, 24), generator=torch.Generator().manual_seed(0))
        labels = torch.cat([ids[:, 1:], torch.full((4, 1), IGNORE_INDEX)], dim=1)
        runner.store.reset_peak()
        runner.loss_sum(ids, labels)
        label_log_likelihoods(runner, PROMPTS, [[3, 4], [5]])
        assert runner.store.device_resident == 0
        peaks[layers] = runner.store.device_peak
    assert peaks[16] == peaks[2]
