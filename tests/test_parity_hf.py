"""The GPT-J components are numerically transformers' GPTJForCausalLM: logits, loss and every gradient."""

import pytest
import torch
from hf_reference import hf_gptj, hf_state, hf_units
from torch.func import functional_call

from ipuft.components import IGNORE_INDEX
from ipuft.engine.model import build_model


def ipuft_forward(parts, units, ids, labels=None):
    layers = parts.program.layers
    h = functional_call(parts.modules["embeddings"], units["embeddings"], (ids,))
    for n in range(layers):
        h = functional_call(parts.modules["decoder"], units[f"decoder.{n}"], (h,))
    args = (h,) if labels is None else (h, labels)
    return functional_call(parts.modules["head"], units["head"], args)


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_logits_loss_and_gradients_match_transformers(hooks, make_config, kernel):
    cfg = make_config(f"plugins.gptj_decoder.attention_kernel={kernel}", "model.layers=3")
    hf = hf_gptj(cfg)
    parts = build_model(cfg, hooks)
    units = hf_units(parts.modules, cfg.model.layers, {k: v.detach().clone().requires_grad_() for k, v in
                                                      hf.state_dict().items()})
    ids = torch.randint(0, cfg.model.embedding.vocab_size, (3, cfg.model.sequence_length),
                        generator=torch.Generator().manual_seed(1))

    hf_out = hf(ids, labels=ids)
    logits = ipuft_forward(parts, units, ids)
    torch.testing.assert_close(logits, hf_out.logits, atol=1e-5, rtol=0)

    # Hugging Face shifts inside the loss; ipuft's head takes labels already shifted by one.
    labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), IGNORE_INDEX)], dim=1)
    loss = ipuft_forward(parts, units, ids, labels)
    torch.testing.assert_close(loss, hf_out.loss, atol=1e-6, rtol=1e-6)

    hf_out.loss.backward()
    loss.backward()
    ours = hf_state(parts.modules, cfg.model.layers, units)
    hf_params = dict(hf.named_parameters())
    assert set(ours) == set(hf_params)
    for name, p in hf_params.items():
        torch.testing.assert_close(ours[name].grad, p.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_every_variable_maps_to_a_distinct_hf_parameter(hooks, make_config):
    cfg = make_config()
    parts = build_model(cfg, hooks)
    hf = hf_gptj(cfg)
    mapped = hf_state(parts.modules, cfg.model.layers,
                   {u: {v.name: v for v in parts.variables[u.role]}
                    for u in parts.program.units()})
    shapes = {name: tuple(p.shape) for name, p in hf.named_parameters()}
    assert {name: spec.shape for name, spec in mapped.items()} == shapes
