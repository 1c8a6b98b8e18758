"""Plugin discovery through real entry-point lookups, registries, and plugin failures."""

import inspect

import pytest
import torch
from torch.func import functional_call

from ipuft import hookspecs
from ipuft.config.rules import check_plugins
from ipuft.engine.model import build_model
from ipuft.errors import PluginError
from ipuft.plugins import create_plugin_manager

SHIPPED = {"ipuft-embeddings", "ipuft-decoder", "ipuft-lm-head", "ipuft-optim-adam", "ipuft-optim-adamw8bit",
           "ipuft-llama", "ipuft-lora"}


def test_shipped_plugins_are_six_distributions_and_the_builtin_logging_backends(hooks):
    described = {p["distribution"]: p for p in hooks.describe()}
    assert set(described) == {*SHIPPED, "ipuft"}
    assert described["ipuft"]["name"] == "ipuft.loggers"
    assert described["ipuft"]["loggers"] == ["tensorboard", "wandb"]
    assert described["ipuft-embeddings"]["components"] == ["embeddings:gptj"]
    assert described["ipuft-decoder"]["components"] == ["decoder:gptj"]
    assert described["ipuft-decoder"]["config_sections"] == ["plugins.gptj_decoder"]
    assert described["ipuft-decoder"]["model_families"] == ["gptj"]
    assert described["ipuft-llama"]["components"] == ["embeddings:llama", "decoder:llama", "head:llama"]
    assert described["ipuft-llama"]["config_sections"] == ["plugins.llama"]
    assert described["ipuft-llama"]["model_families"] == ["llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma2", "gemma3_text", "phi3"]
    assert described["ipuft-lm-head"]["components"] == ["head:gptj"]
    assert described["ipuft-lora"]["config_sections"] == ["plugins.lora"]
    assert described["ipuft-optim-adam"]["optimizers"] == ["adamw"]
    assert described["ipuft-optim-adamw8bit"]["optimizers"] == ["adamw8bit"]
    assert described["ipuft-optim-adamw8bit"]["config_sections"] == ["plugins.adamw8bit"]
    assert all(p["version"] == "0.1.0" for p in described.values())


def test_custom_head_from_an_entry_point(fake_dist, make_config):
    fake_dist("ipuft-test-head", {"tiny_lm_head": "ipuft_test_head"})
    hooks = create_plugin_manager()
    described = {p["name"]: p for p in hooks.describe()}
    assert described["tiny_lm_head"]["distribution"] == "ipuft-test-head"
    assert described["tiny_lm_head"]["components"] == ["head:tiny_lm"]

    cfg = make_config("model.head=tiny_lm")
    parts = build_model(cfg, hooks)
    assert [v.name for v in parts.variables["head"]] == ["norm_scale", "proj"]
    assert type(parts.modules["head"]).__name__ == "TinyLMHead"

    from ipuft.data.batch import Batch
    from ipuft.engine.phased import PhasedEngine

    engine = PhasedEngine(cfg, parts, hooks.registrations.optimizers.get("adamw").build(cfg), torch.device("cpu"))
    ids = torch.randint(0, 128, (cfg.gradient_accumulation, 1, 9), generator=torch.Generator().manual_seed(0))
    w = {u: {n: t.clone() for n, t in v.items()} for u, v in engine.model.weights().items()}
    expected = []
    for mb in range(cfg.gradient_accumulation):
        h = functional_call(parts.modules["embeddings"], w["embeddings"], (ids[mb, :, :-1],))
        for n in range(cfg.model.layers):
            h = functional_call(parts.modules["decoder"], w[f"decoder.{n}"], (h,))
        expected.append(functional_call(parts.modules["head"], w["head"], (h, ids[mb, :, 1:])))
    result = engine.step(Batch(ids[..., :-1], ids[..., 1:]), lr=1e-3)
    assert result.loss == pytest.approx(torch.stack(expected).mean().item(), rel=1e-6)
    assert not torch.equal(engine.model.weights()["head"]["proj"], w["head"]["proj"])  # the custom head trains


def test_unknown_component_names_the_choices(hooks, make_config):
    with pytest.raises(PluginError, match=r"model.head: unknown head component 'nope'; available: gptj, llama$"):
        build_model(make_config("model.head=nope"), hooks)


def test_duplicate_component_is_refused(fake_dist):
    fake_dist("ipuft-dup", {"dup": "dup_plugin"}, {"dup_plugin": """
        from ipuft import hookimpl
        @hookimpl
        def ipuft_register_components(registry):
            registry.add("decoder", "gptj", lambda cfg: None)
    """})
    with pytest.raises(PluginError, match=r"decoder component 'gptj' is registered twice: by plugin '.*' and by plugin '.*'"):
        _ = create_plugin_manager().registrations


def test_shard_specs_that_are_not_a_mapping_are_refused_naming_the_plugin_and_the_hook(fake_dist):
    """A registration's shard specs are a mapping; a computed layout is an answer to ipuft_shard_spec."""
    fake_dist("ipuft-computed", {"computed": "computed_plugin"}, {"computed_plugin": """
        from ipuft import hookimpl
        from ipuft.sharding import replicated
        @hookimpl
        def ipuft_register_components(registry):
            registry.add("head", "computed", lambda cfg: None, shard_specs=lambda variables, tp: replicated(variables))
    """})
    with pytest.raises(PluginError) as info:
        _ = create_plugin_manager().registrations
    assert str(info.value) == ("plugin 'computed' registers head component 'computed' with shard_specs of type "
                               "function: give a mapping of variable name to ShardSpec, or answer the "
                               "ipuft_shard_spec hook for a layout computed from the variables or the config")


def test_a_config_sections_model_keys_are_its_fields(fake_dist):
    """A section's ``model_keys`` name fields of its dataclass: a misspelt one would silently fix nothing."""
    fake_dist("ipuft-shapes", {"shapes": "shapes_plugin"}, {"shapes_plugin": """
        from dataclasses import dataclass
        from ipuft import hookimpl
        @dataclass
        class Options:
            rank: int = 8
        @hookimpl
        def ipuft_register_config_sections(registry):
            registry.add("shapes", Options, model_keys=("rnak",))
    """})
    with pytest.raises(PluginError) as info:
        _ = create_plugin_manager().registrations
    assert str(info.value) == "plugin 'shapes': config section 'shapes' names model key 'rnak', which is not a field of Options"


def test_plugin_that_fails_to_import(fake_dist, monkeypatch):
    fake_dist("ipuft-broken", {"broken": "broken_plugin"}, {"broken_plugin": "raise RuntimeError('boom')\n"})
    with pytest.raises(PluginError) as info:
        create_plugin_manager()
    assert str(info.value) == ("plugin 'broken' (distribution ipuft-broken 0.1.0) failed to import: RuntimeError: "
                               "boom; fix or uninstall it, or set IPUFT_DISABLE_PLUGINS=broken (IPUFT_DEBUG=1 shows the traceback)")
    monkeypatch.setenv("IPUFT_DISABLE_PLUGINS", "broken")
    assert "broken" not in create_plugin_manager().infos


def test_misspelled_hook_is_caught_by_check_pending(fake_dist):
    fake_dist("ipuft-typo", {"typo": "typo_plugin"}, {"typo_plugin": """
        from ipuft import hookimpl
        @hookimpl
        def ipuft_register_component(registry):
            pass
    """})
    with pytest.raises(PluginError, match="ipuft_register_component"):
        create_plugin_manager()


def test_plugin_error_during_registration_is_attributed(fake_dist):
    fake_dist("ipuft-bad", {"bad": "bad_plugin"}, {"bad_plugin": """
        from ipuft import hookimpl
        @hookimpl
        def ipuft_register_optimizers(registry):
            raise KeyError("oops")
    """})
    with pytest.raises(PluginError, match="plugin 'bad' failed in ipuft_register_optimizers: KeyError"):
        _ = create_plugin_manager().registrations


def test_uninstalled_plugin_makes_its_component_unavailable(monkeypatch, make_config):
    from ipuft import plugins

    real = plugins.metadata.entry_points

    def without_decoder(**kwargs):
        return [ep for ep in real(**kwargs) if ep.dist.metadata["Name"] != "ipuft-decoder"]

    monkeypatch.setattr(plugins.metadata, "entry_points", without_decoder)
    hooks = create_plugin_manager()
    assert {p["distribution"] for p in hooks.describe()} == SHIPPED - {"ipuft-decoder"} | {"ipuft"}
    with pytest.raises(PluginError, match=r"model.decoder: unknown decoder component 'gptj'; available: llama$"):
        check_plugins(make_config(), hooks.registrations)


def test_disabling_by_name_or_distribution(monkeypatch):
    monkeypatch.setenv("IPUFT_DISABLE_PLUGINS", "gptj_lm_head, ipuft-optim-adam, optim_adamw8bit")
    hooks = create_plugin_manager()
    assert {p["name"] for p in hooks.describe()} == {"gptj_embeddings", "gptj_decoder", "llama", "lora", "ipuft.loggers"}
    assert hooks.registrations.optimizers.names() == []


def test_every_hook_is_prefixed_documented_and_called(fake_dist, make_config):
    """A meta-test: a new hook needs a docstring, an entry in docs/plugins.md, and a caller in core, which
    calls it through pluggy (so pluggy's call monitoring sees every one)."""
    import pathlib

    import click

    specs = {name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("ipuft_")}
    assert len(specs) == 9
    docs = (pathlib.Path(__file__).parent.parent / "docs" / "plugins.md").read_text()
    for name in specs:
        assert getattr(hookspecs, name).__doc__, name
        assert f"`{name}(" in docs, f"{name} is not documented in docs/plugins.md"

    fake_dist("ipuft-test-head", {"tiny_lm_head": "ipuft_test_head"})  # registers no shard specs: the hook is asked
    hooks = create_plugin_manager()
    called = set()
    hooks.pm.add_hookcall_monitoring(lambda name, impls, kwargs: called.add(name), lambda *a: None)
    _ = hooks.registrations
    hooks.register_commands(click.Group())
    build_model(make_config("model.head=tiny_lm", "model.adapter=lora"), hooks)
    assert called == specs


def test_a_wrapper_runs_around_the_other_implementations(fake_dist):
    """``@hookimpl(wrapper=True)`` works because core calls every hook through pluggy: the wrapper sees the
    registry before and after every other plugin registered."""
    fake_dist("ipuft-wrap", {"wrap": "wrap_plugin"}, {"wrap_plugin": """
        from ipuft import hookimpl
        seen = {}
        @hookimpl(wrapper=True)
        def ipuft_register_components(registry):
            seen["before"] = registry.names("decoder")
            result = yield
            seen["after"] = registry.names("decoder")
            return result
    """})
    import wrap_plugin

    create_plugin_manager().registrations  # noqa: B018
    assert wrap_plugin.seen == {"before": [], "after": ["gptj", "llama"]}


def _optimizer_plugin(name):
    """A plugin object registering optimizer ``name``: every one made here runs the same code object."""
    from ipuft import hookimpl

    class Plugin:
        @hookimpl
        def ipuft_register_optimizers(self, registry):
            registry.add(name, lambda cfg: None)

        @hookimpl
        def ipuft_register_components(self, registry):
            if name == "broken":
                raise ValueError(f"{name} plugin's bug")

    return Plugin()


def test_registrations_are_attributed_by_each_plugins_bound_hooks_even_when_they_share_code():
    """Each plugin's hook implementations are bound to its name when it is registered: two plugins running one
    code object (here, one class body) are still told apart, in what they register and in what they raise."""
    hooks = create_plugin_manager(extra_plugins=[("first", _optimizer_plugin("one")),
                                                 ("second", _optimizer_plugin("two"))])
    described = {p["name"]: p for p in hooks.describe()}
    assert (described["first"]["optimizers"], described["second"]["optimizers"]) == (["one"], ["two"])
    assert hooks.registrations.optimizers.get("two").plugin == "second"
    hooks = create_plugin_manager(extra_plugins=[("fine", _optimizer_plugin("one")),
                                                 ("faulty", _optimizer_plugin("broken"))])
    with pytest.raises(PluginError) as info:
        _ = hooks.registrations
    assert str(info.value) == ("plugin 'faulty' failed in ipuft_register_components: ValueError: broken plugin's "
                               "bug (IPUFT_DEBUG=1 shows the traceback)")


def test_a_wrappers_own_registrations_are_its_and_those_it_yields_to_are_the_others(fake_dist):
    fake_dist("ipuft-wrap-add", {"wrap_add": "wrap_add_plugin"}, {"wrap_add_plugin": """
        from ipuft import hookimpl
        @hookimpl(wrapper=True)
        def ipuft_register_optimizers(registry):
            registry.add("before", lambda cfg: None)
            result = yield
            registry.add("after", lambda cfg: None)
            return result
    """})
    optimizers = {b.name: b.plugin for b in create_plugin_manager().registrations.optimizers}
    assert optimizers == {"before": "wrap_add", "adamw": "optim_adam", "adamw8bit": "optim_adamw8bit",
                          "after": "wrap_add"}


def test_one_plugin_object_under_two_names_is_refused():
    plugin = _optimizer_plugin("one")
    with pytest.raises(PluginError, match=r"^plugin 'again' cannot be registered: already registered as 'once'$"):
        create_plugin_manager(extra_plugins=[("once", plugin), ("again", plugin)])


def test_a_stock_component_is_overridden_by_ordering_not_by_uninstalling(fake_dist, make_config):
    """A ``tryfirst`` registration of the same role and name wins; the stock one is shadowed, listed, and its
    shard specs are not used. The same registration without tryfirst is a duplicate, one line."""
    source = """
        import torch
        from ipuft import hookimpl
        from ipuft_decoder import SHARD_SPECS, build as stock_build

        class Louder(torch.nn.Module):
            def __init__(self, block):
                super().__init__()
                self.block = block
            def forward(self, x, cache=None):
                return self.block(x, cache) * 2.0
            def variable_specs(self):
                return [type(v)("block." + v.name, v.shape, v.dtype, v.init) for v in self.block.variable_specs()]
            def hf_mapping(self, layer):
                return {"block." + k: v for k, v in self.block.hf_mapping(layer).items()}

        @hookimpl(MARKER)
        def ipuft_register_components(registry):
            registry.add("decoder", "gptj", lambda cfg: Louder(stock_build(cfg)), "louder GPT-J",
                         shard_specs={"block." + k: v for k, v in SHARD_SPECS.items()})
    """
    fake_dist("ipuft-louder", {"louder": "louder_plugin"},
              {"louder_plugin": source.replace("MARKER", "tryfirst=True")})
    hooks = create_plugin_manager()
    parts = build_model(make_config("execution.tensor_parallel=2"), hooks)
    assert type(parts.modules["decoder"]).__name__ == "Louder"
    assert parts.shard_specs["decoder"]["block.attn.q_proj.weight"].tp_dim == 0
    described = {p["name"]: p for p in hooks.describe()}
    assert described["louder"]["components"] == ["decoder:gptj"]
    assert described["gptj_decoder"]["components"] == []
    assert described["gptj_decoder"]["shadowed"] == ["decoder component 'gptj' (overridden by plugin 'louder')"]

    fake_dist("ipuft-louder2", {"louder2": "louder2_plugin"}, {"louder2_plugin": source.replace("MARKER", "")})
    with pytest.raises(PluginError, match=r"^decoder component 'gptj' is registered twice: by plugin '\w+' and by "
                                          r"plugin '\w+'; disable one .* tryfirst=True$"):
        create_plugin_manager(disabled={"louder"}).registrations  # noqa: B018


HOOK_CALLS = {
    "ipuft_register_components": "registry", "ipuft_register_optimizers": "registry",
    "ipuft_register_loggers": "registry", "ipuft_register_config_sections": "registry",
    "ipuft_register_model_families": "registry",
    "ipuft_register_commands": "cli", "ipuft_shard_spec": "role, name, variables, tensor_parallel",
    "ipuft_emit_phases": "program, role, name", "ipuft_adapt_component": "adapter, role, name, module",
}


@pytest.mark.parametrize("hook", sorted(HOOK_CALLS))
@pytest.mark.parametrize("debug", [False, True])
def test_an_exception_in_any_hook_is_one_line_naming_the_plugin_and_the_hook(fake_dist, capsys, monkeypatch, hook,
                                                                               debug):
    """Whatever hook raises, ``ipuft plan`` (which calls every one; the test head registers no shard specs, so
    ``ipuft_shard_spec`` is asked) prints one line naming the plugin and the hook and exits 2; with --debug
    the traceback comes first."""
    from cli_helpers import run_cli

    monkeypatch.setenv("IPUFT_DEBUG", "0")  # off; --debug sets it to 1, and the test puts it back afterwards
    fake_dist("ipuft-test-head", {"tiny_lm_head": "ipuft_test_head"})

    assert set(HOOK_CALLS) == {n for n, _ in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("ipuft_")}
    fake_dist("ipuft-raiser", {"raiser": "raiser_plugin"}, {"raiser_plugin": f"""
        from ipuft import hookimpl
        @hookimpl
        def {hook}({HOOK_CALLS[hook]}):
            raise ZeroDivisionError("bad arithmetic in the plugin")
    """})
    adapter = ["model.adapter=raised"] if hook == "ipuft_adapt_component" else []  # asked only with an adapter
    code, _, err = run_cli(capsys, *(["--debug"] if debug else []), "plan", "--config", "tiny", "model.head=tiny_lm",
                           *adapter)
    assert code == 2
    line = (f"ipuft: error: plugin 'raiser' failed in {hook}: ZeroDivisionError: bad arithmetic in the plugin "
            f"(IPUFT_DEBUG=1 shows the traceback)\n")
    if debug:
        assert err.startswith("Traceback") and "raiser_plugin.py" in err and err.endswith(line)
    else:
        assert err == line


def test_a_non_elementwise_optimizer_is_refused_under_rts_and_a_changed_optimizer_on_resume(fake_dist, capsys,
                                                                                            trained):
    """An optimizer registered with elementwise=False needs whole tensors: RTS's flat shards are refused with
    one line. Resuming a checkpoint with another optimizer says so in one line."""
    from cli_helpers import run_cli

    fake_dist("ipuft-rowwise", {"rowwise": "rowwise_plugin"}, {"rowwise_plugin": """
        from ipuft import hookimpl
        @hookimpl
        def ipuft_register_optimizers(registry):
            registry.add("rowwise", lambda cfg: None, "per-row statistics", elementwise=False)
    """})
    code, _, err = run_cli(capsys, "plan", "--config", "tiny", "training.optimizer.name=rowwise", "execution.rts=true")
    assert (code, err) == (2, "ipuft: error: training.optimizer.name: rowwise is not elementwise (it needs whole "
                              "tensors), but execution.rts shards each variable over the data-parallel ranks; set "
                              "execution.rts=false\n")
    code, _, err = run_cli(capsys, "train", "--checkpoint", str(trained / "run"), "training.optimizer.name=rowwise",
                           "training.steps=3", f"output_dir={trained / 'other'}")
    assert code == 2
    assert err.startswith("ipuft: error: checkpoint.load: ") and \
        "holds the state of optimizer adamw, which training.optimizer.name=rowwise cannot resume" in err and \
        err.count("\n") == 1


def test_a_component_that_raises_in_its_build_or_specs_is_one_line(fake_dist, capsys):
    from cli_helpers import run_cli

    fake_dist("ipuft-brittle", {"brittle": "brittle_plugin"}, {"brittle_plugin": """
        from ipuft import hookimpl
        from ipuft_lm_head import SHARD_SPECS, build as stock_build

        def build(cfg):
            head = stock_build(cfg)

            class Brittle(type(head)):
                def variable_specs(self):
                    raise KeyError("gain")

            head.__class__ = Brittle
            return head

        @hookimpl(tryfirst=True)
        def ipuft_register_components(registry):
            registry.add("head", "gptj", build, "a head whose specs raise", shard_specs=SHARD_SPECS)
    """})
    code, _, err = run_cli(capsys, "plan", "--config", "tiny")
    assert (code, err) == (2, "ipuft: error: head component 'gptj' of plugin 'brittle' failed in variable_specs(): "
                              "KeyError: 'gain'\n")


def test_an_optimizer_that_is_not_an_ipuft_optimizer_is_refused_in_one_line(make_config):
    """The engine calls only what :class:`ipuft.optim.Optimizer` declares (its attributes and ``fused_step``
    included, with their defaults), so a plugin's build that makes something else is refused when it is built,
    not at the first attribute the update reads."""
    from omegaconf import OmegaConf

    hooks = create_plugin_manager(extra_plugins=[("odd", _optimizer_plugin("one"))])
    cfg = OmegaConf.create({"training": {"optimizer": {"name": "one"}}})
    with pytest.raises(PluginError) as raised:
        hooks.registrations.build_optimizer(cfg)
    assert str(raised.value) == ("training.optimizer.name=one: plugin 'odd' built a NoneType, not an "
                                 "ipuft.optim.Optimizer; subclass it")
    adamw = hooks.registrations.build_optimizer(make_config("training.optimizer.name=adamw"))
    from ipuft.optim import has_fused_step

    assert has_fused_step(adamw) and adamw.block_size == 1 and adamw.block_states == frozenset()
