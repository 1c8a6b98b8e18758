"""``ipuft.testing``: the ``install_plugin`` fixture (a real entry point, undone after the test) and
``assert_parity`` (the engine against a plain reference over ipuft's own modules), including a wrong
reference that must fail."""

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from test_engine import EQUIVALENCE, STEPS, adam_update, initial_weights, make_engine, reference_training

import ipuft.testing
from ipuft.config import load_config
from ipuft.plugins import create_plugin_manager
from ipuft.testing import PluginInstaller, assert_parity, max_rel

FIXTURES = Path(__file__).parent / "fixtures"


def sgd_by_hand(momentum):
    buf = {}

    def update(name, p, g, lr, t):
        buf[name] = momentum * buf.get(name, 0) + g
        p -= lr * buf[name]

    return update


SGD = ["training.optimizer.name=sgd", "plugins.sgd.momentum=0.8", "training.global_batch_size=4",
       "execution.micro_batch_size=2", "execution.loss_scaling=8", "training.optimizer.gradient_clipping=0.1",
       "training.optimizer.learning_rate.maximum=0.05"]


def test_the_fixture_is_a_pytest_plugin_of_the_ipuft_distribution(request):
    assert request.config.pluginmanager.get_plugin("ipuft") is ipuft.testing
    # Every distribution on the path, as pytest reads them (a source tree's stale *.egg-info may come first).
    declared = {(ep.name, dist.metadata["Name"]) for dist in metadata.distributions() for ep in dist.entry_points
                if ep.group == "pytest11" and ep.value == "ipuft.testing"}
    assert declared == {("ipuft", "ipuft")}


def test_install_plugin_installs_through_a_real_entry_point(install_plugin):
    hooks = install_plugin("ipuft_test_sgd", name="sgd", path=FIXTURES)
    described = {p["name"]: p for p in hooks.describe()}
    assert described["sgd"]["distribution"] == "ipuft-testing-sgd"
    assert described["sgd"]["optimizers"] == ["sgd"] and described["sgd"]["config_sections"] == ["plugins.sgd"]
    (entry,) = [ep for ep in metadata.entry_points(group="ipuft") if ep.name == "sgd"]
    assert entry.value == "ipuft_test_sgd"

    # Processes the test starts find it too (PYTHONPATH), as torchrun's ranks must.
    code = "from ipuft.plugins import create_plugin_manager; print(sorted(create_plugin_manager().infos))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "'sgd'" in out


def test_install_plugin_from_source_and_its_undoing(tmp_path):
    source = """
        from ipuft import hookimpl
        from ipuft_test_sgd import SGD

        @hookimpl
        def ipuft_register_optimizers(registry):
            registry.add("plain_sgd", lambda cfg: SGD(0.0), "SGD without momentum")
    """
    before = sys.path.copy()
    with pytest.MonkeyPatch.context() as patch:
        installer = PluginInstaller(tmp_path, patch)
        installer.add_path(FIXTURES)
        hooks = installer("inline_sgd", source=source)
        assert hooks.registrations.optimizers.names() == ["adamw", "adamw8bit", "plain_sgd"]
        assert {p["name"]: p["distribution"] for p in hooks.describe()}["inline_sgd"] == "ipuft-testing-inline-sgd"
    assert sys.path == before
    assert "inline_sgd" not in create_plugin_manager().infos


def test_an_installed_entry_point_is_used_as_it_is(install_plugin):
    """The plugin under test already installed (``pip install -e``): no second distribution declares it."""
    hooks = install_plugin("ipuft_decoder", name="gptj_decoder")
    described = {p["name"]: p for p in hooks.describe()}
    assert described["gptj_decoder"]["distribution"] == "ipuft-decoder"
    assert [ep.dist.metadata["Name"] for ep in metadata.entry_points(group="ipuft") if ep.name == "gptj_decoder"] == [
        "ipuft-decoder"]


def test_parity_of_the_stock_adam_and_the_reference_equals_transformers_gptj(hooks):
    """The helper's reference (ipuft's own modules, functional_call) takes the same steps as test_engine's
    (transformers' GPT-J as one module), and the engine agrees with it."""
    cfg = load_config("tiny", list(EQUIVALENCE), hooks.registrations.config_sections)
    parity = assert_parity(hooks, EQUIVALENCE, adam_update(cfg), steps=STEPS, rtol=1e-5)
    hf_losses, hf_norms, hf_weights = reference_training(cfg, initial_weights(make_engine(cfg, hooks), cfg))
    for ours, theirs in ((parity.reference_losses, hf_losses), (parity.reference_grad_norms, hf_norms)):
        assert max(abs(a - b) / b for a, b in zip(ours, theirs, strict=True)) <= 1e-5
    assert parity.reference_weights.keys() == hf_weights.keys()
    for name, w in hf_weights.items():
        assert max_rel(parity.reference_weights[name], w) <= 1e-5, name
    assert min(parity.reference_grad_norms) > 4 * cfg.training.optimizer.gradient_clipping  # clipping is active


def test_parity_of_a_plugin_optimizer(install_plugin):
    hooks = install_plugin("ipuft_test_sgd", name="sgd", path=FIXTURES)
    parity = assert_parity(hooks, SGD, sgd_by_hand(0.8), steps=4, rtol=1e-5)
    assert len(parity.losses) == len(parity.reference_losses) == 4
    assert max(abs(a - b) / b for a, b in zip(parity.losses, parity.reference_losses, strict=True)) <= 1e-5
    assert set(parity.weights) == set(parity.reference_weights) == set(parity.initial_weights)
    assert "transformer.h.1.mlp.fc_out.bias" in parity.weights and "lm_head.weight" in parity.weights


def test_a_wrong_reference_update_fails_the_parity_assertion(install_plugin):
    """Momentum 0.9 by hand against the plugin's 0.8: the first two steps' losses agree (the first update's buffer
    is the gradient, whatever the momentum), the third's not."""
    hooks = install_plugin("ipuft_test_sgd", name="sgd", path=FIXTURES)
    with pytest.raises(AssertionError, match=r"^step 3: engine loss .* against the reference's .* \(relative "
                                             r"difference .* > rtol 1e-05\)$"):
        assert_parity(hooks, SGD, sgd_by_hand(0.9), steps=4, rtol=1e-5)


def test_a_wrong_final_update_fails_on_the_weights(install_plugin):
    """A mistake in the last update shows in no loss: the weights catch it, by name."""
    hooks = install_plugin("ipuft_test_sgd", name="sgd", path=FIXTURES)
    right = sgd_by_hand(0.8)

    def wrong_at_the_end(name, p, g, lr, t):
        right(name, p, g, lr * (1.5 if t == 3 and name == "lm_head.bias" else 1.0), t)

    with pytest.raises(AssertionError, match=r"^weight lm_head.bias after 3 steps: max \|engine - reference\| / "
                                             r"max \|reference\| = .* > rtol 1e-05$"):
        assert_parity(hooks, SGD, wrong_at_the_end, steps=3, rtol=1e-5)


def test_a_rule_that_moves_nothing_fails_unless_that_is_meant(install_plugin):
    hooks = install_plugin("ipuft_test_sgd", name="sgd", path=FIXTURES)
    frozen = [*SGD, "training.optimizer.learning_rate.maximum=0"]
    with pytest.raises(AssertionError, match=r"^weight transformer.wte.weight never changed in 2 steps"):
        assert_parity(hooks, frozen, sgd_by_hand(0.8), steps=2)
    parity = assert_parity(hooks, frozen, sgd_by_hand(0.8), steps=2, require_change=False)
    assert all(torch.equal(w, parity.initial_weights[name]) for name, w in parity.weights.items())


@pytest.mark.parametrize(("override", "message"), [
    ("execution.tensor_parallel=2", "assert_parity runs one process"),
    ("model.dropout_prob=0.1", "assert_parity needs model.dropout_prob=0"),
])
def test_parity_refuses_what_one_plain_process_cannot_reproduce(hooks, override, message):
    with pytest.raises(ValueError, match=message):
        assert_parity(hooks, [override], sgd_by_hand(0.0), steps=1)
