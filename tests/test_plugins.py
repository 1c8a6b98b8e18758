"""Plugin discovery through real entry-point lookups, registries, and plugin failures."""

import inspect

import pytest
import torch
from torch.func import functional_call

from ipuft import hookspecs
from ipuft.errors import PluginError
from ipuft.model import build_model
from ipuft.plugins import create_plugin_manager

SHIPPED = {"ipuft-embeddings", "ipuft-decoder", "ipuft-lm-head", "ipuft-optim-adam"}


def test_shipped_plugins_are_four_distributions_and_the_builtin_logging_backends(hooks):
    described = {p["distribution"]: p for p in hooks.describe()}
    assert set(described) == {*SHIPPED, "ipuft"}
    assert described["ipuft"]["name"] == "ipuft.loggers"
    assert described["ipuft"]["loggers"] == ["tensorboard", "wandb"]
    assert described["ipuft-embeddings"]["components"] == ["embeddings:gptj"]
    assert described["ipuft-decoder"]["components"] == ["decoder:gptj"]
    assert described["ipuft-decoder"]["config_sections"] == ["plugins.gptj_decoder"]
    assert described["ipuft-lm-head"]["components"] == ["head:gptj"]
    assert described["ipuft-optim-adam"]["optimizers"] == ["adamw"]
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

    from ipuft.engine import Batch, PhasedEngine

    engine = PhasedEngine(cfg, parts, hooks.registrations.optimizers.get("adamw").build(cfg), torch.device("cpu"))
    ids = torch.randint(0, 128, (cfg.gradient_accumulation, 1, 9), generator=torch.Generator().manual_seed(0))
    w = {u: {n: t.clone() for n, t in v.items()} for u, v in engine.weights().items()}
    expected = []
    for mb in range(cfg.gradient_accumulation):
        h = functional_call(parts.modules["embeddings"], w["embeddings"], (ids[mb, :, :-1],))
        for n in range(cfg.model.layers):
            h = functional_call(parts.modules["decoder"], w[f"decoder.{n}"], (h,))
        expected.append(functional_call(parts.modules["head"], w["head"], (h, ids[mb, :, 1:])))
    result = engine.step(Batch(ids[..., :-1], ids[..., 1:]), lr=1e-3)
    assert result.loss == pytest.approx(torch.stack(expected).mean().item(), rel=1e-6)
    assert not torch.equal(engine.weights()["head"]["proj"], w["head"]["proj"])  # the custom head trains


def test_unknown_component_names_the_choices(hooks, make_config):
    with pytest.raises(PluginError, match=r"model.head: unknown head component 'nope'; available: gptj$"):
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


def test_plugin_that_fails_to_import(fake_dist, monkeypatch):
    fake_dist("ipuft-broken", {"broken": "broken_plugin"}, {"broken_plugin": "raise RuntimeError('boom')\n"})
    with pytest.raises(PluginError) as info:
        create_plugin_manager()
    assert str(info.value) == ("plugin 'broken' (distribution ipuft-broken 0.1.0) failed to import: RuntimeError: "
                               "boom; fix or uninstall it, or set IPUFT_DISABLE_PLUGINS=broken")
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
    with pytest.raises(PluginError, match=r"model.decoder: unknown decoder component 'gptj'; available: \(none installed\)"):
        hooks.registrations.check(make_config())


def test_disabling_by_name_or_distribution(monkeypatch):
    monkeypatch.setenv("IPUFT_DISABLE_PLUGINS", "gptj_lm_head, ipuft-optim-adam")
    hooks = create_plugin_manager()
    assert {p["name"] for p in hooks.describe()} == {"gptj_embeddings", "gptj_decoder", "ipuft.loggers"}
    assert hooks.registrations.optimizers.names() == []


def test_every_hook_is_prefixed_documented_and_called(make_config):
    """A meta-test: a new hook needs a docstring, an entry in docs/plugins.md, and a caller in core."""
    import pathlib

    import click

    specs = {name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("ipuft_")}
    assert len(specs) == 7
    docs = (pathlib.Path(__file__).parent.parent / "docs" / "plugins.md").read_text()
    for name in specs:
        assert getattr(hookspecs, name).__doc__, name
        assert f"`{name}(" in docs, f"{name} is not documented in docs/plugins.md"

    hooks = create_plugin_manager()
    called = set()
    hooks.pm.add_hookcall_monitoring(lambda name, impls, kwargs: called.add(name), lambda *a: None)
    _ = hooks.registrations  # registration hooks are called impl by impl, so record them from the impls
    called |= {name for name in specs if name.startswith("ipuft_register_") and name != "ipuft_register_commands"
               and getattr(hooks.pm.hook, name).get_hookimpls()}
    hooks.register_commands(click.Group())
    called.add("ipuft_register_commands")
    build_model(make_config("execution.tensor_parallel=2"), hooks)
    assert called == specs
