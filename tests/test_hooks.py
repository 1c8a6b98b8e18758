"""The model-construction hooks used for real, through the engine: a plugin that emits its own phases (the
embeddings' update moved out of their backward phase, into the head's stage), and one that answers
``ipuft_shard_spec`` for a component registered without shard specs, which then runs at tensor_parallel=2."""

import dist_workers
import pytest
import torch
from distributed import spawn
from test_engine import batches

from ipuft.engine.model import build_model
from ipuft.engine.phased import PhasedEngine
from ipuft.errors import ConfigError
from ipuft.plan.estimate import estimate
from ipuft.plugins import create_plugin_manager

SPLIT_EMBEDDINGS = """
    from ipuft import hookimpl
    from ipuft.program import Op, Phase, Stage
    from ipuft_embeddings import build
    from ipuft.sharding import VOCAB_SHARDED

    @hookimpl
    def ipuft_register_components(registry):
        registry.add("embeddings", "gptj_split", build, "GPT-J embeddings, updated in the head's stage",
                     shard_specs={"wte.weight": VOCAB_SHARDED})

    @hookimpl
    def ipuft_emit_phases(program, role, name):
        if (role, name) != ("embeddings", "gptj_split"):
            return None
        program.emit(Stage.EMBEDDINGS_FORWARD, Phase("embeddings", None, (Op.FORWARD,)))
        program.emit(Stage.EMBEDDINGS_BACKWARD_OPTIMIZER, Phase("embeddings", None, (Op.BACKWARD,)))
        program.emit(Stage.EMBEDDINGS_BACKWARD_OPTIMIZER, Phase("embeddings", None, (Op.GLOBAL_NORM,)))
        program.emit(Stage.HEAD_OPTIMIZER, Phase("embeddings", None, (Op.OPTIMIZER_STEP,)))
        return True
"""


def test_a_plugin_emits_its_own_phases_and_the_engine_runs_them(fake_dist, make_config):
    """The split program stores the embeddings' gradient between its backward and its update (so it moves it),
    finishes the global norm in a phase of its own that moves nothing, and updates the embeddings in the head's stage: the
    same steps as the standard program, bit for bit, and its counters equal its plan."""
    fake_dist("ipuft-split-embeddings", {"split_embeddings": "split_embeddings"},
              {"split_embeddings": SPLIT_EMBEDDINGS})
    hooks = create_plugin_manager()
    common = ("training.global_batch_size=4", "execution.activation_offload=true")
    runs = {}
    for name in ("gptj", "gptj_split"):
        cfg = make_config(*common, f"model.embeddings={name}")
        parts = build_model(cfg, hooks)
        engine = PhasedEngine(cfg, parts, hooks.registrations.build_optimizer(cfg), torch.device("cpu"))
        planned = estimate(cfg, parts, hooks)
        results = [engine.step(b, 1e-2) for b in batches(cfg)[:3]]
        for r in results:
            assert r.traffic == planned["traffic"]
        runs[name] = parts.program, results, engine.model.weights()
    program, split, weights = runs["gptj_split"]
    assert [p.name for p in program if p.role == "embeddings"] == [
        "embeddings:forward", "embeddings:backward", "embeddings:global_norm", "embeddings:optimizer_step"]
    assert [p.name for p in program][-2:] == ["embeddings:optimizer_step", "head:optimizer_step"]
    _, standard, expected = runs["gptj"]
    for a, b in zip(split, standard, strict=True):
        assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm)
    for unit, tensors in expected.items():
        for n, t in tensors.items():
            assert torch.equal(weights[unit][n], t), (unit, n)
    embedding_grad = 128 * 64 * 4  # stored after its backward, loaded by its update
    assert split[0].traffic["d2h"]["grad"] == standard[0].traffic["d2h"]["grad"] + embedding_grad
    assert split[0].traffic["h2d"]["grad"] == standard[0].traffic["h2d"]["grad"] + embedding_grad


ANY_TP_HEAD = """
    from ipuft import hookimpl
    from ipuft_test_head import TinyLMHead

    @hookimpl
    def ipuft_register_components(registry):
        registry.add("head", "tiny_lm_any_tp", lambda cfg: TinyLMHead(cfg.model.hidden_size,
                                                                       cfg.model.embedding.vocab_size),
                     "the test head, registered without shard specs")
"""
ITS_SHARD_SPEC = """
    from ipuft import hookimpl
    from ipuft.sharding import replicated

    @hookimpl
    def ipuft_shard_spec(role, name, variables, tensor_parallel):
        if (role, name) == ("head", "tiny_lm_any_tp"):
            return replicated(variables)  # every TP rank computes the head whole
        return None
"""


def test_a_plugin_answers_the_shard_spec_of_a_component_and_it_runs_at_tp2(fake_dist, make_config, tmp_path):
    """A head registered without shard specs is refused at tensor_parallel=2; once another plugin answers
    ipuft_shard_spec for it, two TP ranks train as one process does."""
    overrides = ["training.global_batch_size=4", "model.head=tiny_lm_any_tp"]
    fake_dist("ipuft-any-tp-head", {"any_tp_head": "any_tp_head"}, {"any_tp_head": ANY_TP_HEAD})
    with pytest.raises(ConfigError, match="head component 'tiny_lm_any_tp' declares no tensor-parallel sharding"):
        build_model(make_config(*overrides, "execution.tensor_parallel=2"), create_plugin_manager())
    fake_dist("ipuft-its-shard-spec", {"its_shard_spec": "its_shard_spec"}, {"its_shard_spec": ITS_SHARD_SPEC})
    parts = build_model(make_config(*overrides, "execution.tensor_parallel=2"), create_plugin_manager())
    assert all(spec.replicated_over_tp for spec in parts.shard_specs["head"].values())
    spawn(1, dist_workers.train_configs, {"one": overrides}, 3, str(tmp_path), tmp=tmp_path)
    spawn(2, dist_workers.train_configs, {"tp2": [*overrides, "execution.tensor_parallel=2"]}, 3, str(tmp_path),
          tmp=tmp_path)
    one, tp2 = torch.load(tmp_path / "one.rank0.pt"), torch.load(tmp_path / "tp2.rank0.pt")
    for a, b in zip(one["losses"] + one["norms"], tp2["losses"] + tp2["norms"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a)
    assert tp2["traffic"] == tp2["planned"]
    for unit, tensors in one["weights"].items():
        for n, t in tensors.items():
            assert torch.allclose(tp2["weights"][unit][n], t, rtol=1e-4, atol=1e-6), (unit, n)


SHIFT_ADAPTER = """
    from dataclasses import replace

    import torch
    from torch import nn

    from ipuft import hookimpl
    from ipuft.components import Init
    from ipuft.sharding import REPLICATED

    def shift(module, x):
        return module.shift

    @hookimpl
    def ipuft_adapt_component(adapter, role, name, module, cfg):
        if adapter != "shift" or role != "decoder":
            return None
        proj = module.mlp.fc_out  # a layer's output projection, which the block calls without its bias
        proj.register_parameter("shift", nn.Parameter(torch.empty(proj.weight.shape[0], device=proj.weight.device)))
        proj.adapter = shift

        class Shifted(type(module)):
            def variable_specs(self):
                return [replace(v, init=Init("zeros"), trainable=True, added=True) if v.name == "mlp.fc_out.shift"
                        else replace(v, trainable=False) for v in super().variable_specs()]

            def adapter_shard_specs(self, base):
                return {"mlp.fc_out.shift": REPLICATED}

        module.__class__ = Shifted
        return module
"""


def test_an_adapter_plugin_adapts_a_built_component_and_only_its_variable_trains(fake_dist, make_config):
    """``model.adapter=shift``: a plugin's ``ipuft_adapt_component`` adds a variable to the decoder's output
    projection through ``ipuft.ops.Linear.adapter`` (a learned shift of its output) and freezes the rest. The
    engine trains the shift alone: the decoder's weights stay bit-identical, no gradient or optimizer state is
    stored for them, and the adapted layer computes what the stock one does with the shift added to its bias."""
    from torch.func import functional_call

    fake_dist("ipuft-shift", {"shift": "shift_adapter"}, {"shift_adapter": SHIFT_ADAPTER})
    hooks = create_plugin_manager()
    cfg = make_config("training.global_batch_size=4", "model.adapter=shift", "model.freeze=[embeddings,head]")
    parts = build_model(cfg, hooks)
    assert type(parts.modules["decoder"]).__name__ == "Shifted"
    assert [v.name for v in parts.variables["decoder"] if v.trainable] == ["mlp.fc_out.shift"]
    engine = PhasedEngine(cfg, parts, hooks.registrations.build_optimizer(cfg), torch.device("cpu"))
    before = {u: dict(w) for u, w in engine.model.full_weights().items()}
    planned = estimate(cfg, parts, hooks)
    for b in batches(cfg)[:2]:
        assert engine.step(b, 1e-2).traffic == planned["traffic"]
    after = engine.model.full_weights()
    for n in range(cfg.model.layers):
        unit = f"decoder.{n}"
        assert all(torch.equal(after[unit][k], t) for k, t in before[unit].items() if k != "mlp.fc_out.shift")
        assert after[unit]["mlp.fc_out.shift"].abs().min() > 0
        assert set(engine.store.entries[unit]["grad"]) == {"mlp.fc_out.shift"}
    stock = build_model(make_config("training.global_batch_size=4"), create_plugin_manager()).modules["decoder"]
    weights = after["decoder.0"]
    shifted = {k: t for k, t in weights.items() if k != "mlp.fc_out.shift"}
    shifted["mlp.fc_out.bias"] = weights["mlp.fc_out.bias"] + weights["mlp.fc_out.shift"]
    x = torch.randn(2, cfg.model.sequence_length, cfg.model.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = functional_call(engine.modules["decoder"].to_empty(device="cpu"), weights, (x,))
        theirs = functional_call(stock.to_empty(device="cpu"), shifted, (x,))
    assert (ours - theirs).abs().max() <= 1e-6
