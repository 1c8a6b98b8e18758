"""The Lion plugin: installed through a real entry point (``ipuft.testing``'s ``install_plugin``), trained
through the engine against Lion written out by hand, its config section, bfloat16."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ipuft.config import load_config
from ipuft.errors import ConfigError
from ipuft.optim import StepContext
from ipuft.testing import assert_parity

SOURCE = Path(__file__).resolve().parents[1]  # examples/plugins/lion: importable when not pip-installed
STEPS = 5
# GA=4, a loss scale to remove, clipping active on every step, a warm-up, weight decay on, non-default betas.
PARITY = ("training.optimizer.name=lion", "plugins.lion.beta1=0.8", "plugins.lion.beta2=0.95",
          "plugins.lion.weight_decay=0.5", "training.global_batch_size=8", "execution.micro_batch_size=2",
          "training.optimizer.gradient_clipping=0.05", "training.optimizer.learning_rate.maximum=1e-3",
          "training.optimizer.learning_rate.warmup_proportion=0.4", "execution.loss_scaling=64", "model.layers=3")


@pytest.fixture
def hooks(install_plugin):
    return install_plugin("ipuft_lion", name="lion", path=SOURCE)


def lion_by_hand(beta1, beta2, weight_decay):
    """Chen et al.'s Algorithm 2 over Hugging Face parameter names: no decay for layer norms and biases."""
    m = {}

    def update(name, p, g, lr, t):
        m.setdefault(name, torch.zeros_like(p))
        c = beta1 * m[name] + (1 - beta1) * g
        decay = 0.0 if name.endswith("bias") or ".ln_" in name else weight_decay
        p -= lr * (torch.sign(c) + decay * p)
        m[name] = beta2 * m[name] + (1 - beta2) * g

    return update


def test_five_steps_equal_lion_written_out_by_hand(hooks):
    parity = assert_parity(hooks, PARITY, lion_by_hand(0.8, 0.95, 0.5), steps=STEPS, rtol=2e-6)
    assert min(parity.reference_grad_norms) > 4 * 0.05  # clipping is active on every step
    assert parity.losses[-1] < parity.losses[0]
    # Every update moves each element by lr (plus the decay) where its gradient has ever been non-zero.
    name = "transformer.h.0.attn.q_proj.weight"
    assert (parity.weights[name] - parity.initial_weights[name]).abs().max().item() > 1e-3


def test_decay_skips_norms_and_biases_and_the_state_is_one_float32_tensor(hooks):
    from ipuft.run.runtime import build_engine

    cfg = load_config("tiny", ["training.optimizer.name=lion", "plugins.lion.weight_decay=0.1"],
                      hooks.registrations.config_sections)
    engine = build_engine(cfg, hooks)
    optim = engine.store.entries["decoder.0"]["optim"]
    assert optim.keys() == {f"{v.name}.m" for v in engine.parts.variables["decoder"]}
    assert {t.dtype for t in optim.values()} == {torch.float32}
    assert hooks.registrations.optimizers.elementwise("lion")

    lion = engine.optimizer
    ctx = StepContext(lr=0.01, step=1, global_norm=1.0, grad_factor=1.0)
    for name, decayed in (("decoder.0.attn.q_proj.weight", True), ("head.norm.weight", False),
                          ("decoder.0.mlp.fc_in.bias", False)):
        weight, grad = torch.full((3,), 2.0), torch.tensor([1.0, -1.0, 0.0])
        lion.step(name, weight, grad, {"m": torch.zeros(3)}, ctx)
        base = 2.0 * (1 - 0.01 * 0.1) if decayed else 2.0
        assert weight.tolist() == pytest.approx([base - 0.01, base + 0.01, base], rel=1e-6), name


def test_elementwise_any_slice_updates_as_the_whole(hooks):
    """What ``elementwise=True`` promises (RTS hands each rank a flat shard): two steps on the halves of a
    flattened variable equal two steps on the whole, bit for bit."""
    cfg = load_config("tiny", ["training.optimizer.name=lion", "plugins.lion.weight_decay=0.3"],
                      hooks.registrations.config_sections)
    lion = hooks.registrations.build_optimizer(cfg)
    g = torch.Generator().manual_seed(0)
    weight, grads = torch.randn(6, 5, generator=g), [torch.randn(6, 5, generator=g) for _ in range(2)]
    whole, m = weight.clone(), torch.zeros(6, 5)
    halves, shard_m = weight.clone().flatten(), torch.zeros(30)
    for t, grad in enumerate(grads, 1):
        ctx = StepContext(lr=0.05, step=t, global_norm=1.0, grad_factor=1.0)
        lion.step("decoder.0.attn.q_proj.weight", whole, grad, {"m": m}, ctx)
        for part in (slice(0, 13), slice(13, 30)):
            lion.step("decoder.0.attn.q_proj.weight", halves[part], grad.flatten()[part], {"m": shard_m[part]}, ctx)
    assert torch.equal(halves.view(6, 5), whole)
    assert torch.equal(shard_m.view(6, 5), m)


def test_adam_keys_with_lion_selected_are_one_error_line(hooks):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", ["training.optimizer.name=lion", "plugins.adamw.beta1=0.8"],
                    hooks.registrations.config_sections)
    assert str(info.value) == ("plugins.adamw.beta1 (used when training.optimizer.name=adamw): it is set but does "
                               "nothing in this config; drop it or select what it configures")
    with pytest.raises(ConfigError, match=r"^plugins.lion.beta2 \(used when training.optimizer.name=lion\): it is set"):
        load_config("tiny", ["plugins.lion.beta2=0.9"], hooks.registrations.config_sections)


@pytest.mark.parametrize(("override", "line"), [
    ("plugins.lion.beta1=1.0", "plugins.lion.beta1: must be in [0, 1), got 1.0"),
    ("plugins.lion.beta2=-0.1", "plugins.lion.beta2: must be in [0, 1), got -0.1"),
    ("plugins.lion.weight_decay=-1", "plugins.lion.weight_decay: must be a finite number >= 0, got -1.0"),
    ("plugins.lion.weight_decay=inf", "plugins.lion.weight_decay: must be a finite number >= 0, got inf"),
])
def test_bad_values_are_one_line_from_the_command_line(hooks, capsys, override, line):
    from ipuft.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["plan", "--config", "tiny", "training.optimizer.name=lion", override])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"ipuft: error: {line}\n"


def test_bfloat16_trains(hooks, tmp_path):
    """bfloat16 weights with stochastic rounding: the optimizer sees float32, its state stays float32."""
    from ipuft.run.train import train

    cfg = load_config("tiny", ["training.optimizer.name=lion", "model.precision=bfloat16",
                               "training.stochastic_rounding=true", "training.steps=12",
                               "training.global_batch_size=8", "training.optimizer.learning_rate.maximum=3e-3",
                               "checkpoint.save=null", f"output_dir={tmp_path}/run"],
                      hooks.registrations.config_sections)
    losses = [r["loss"] for r in train(cfg, hooks, progress=False)]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses


def test_the_entry_point_module_imports_no_torch(hooks):
    """Discovering the plugin (every ``ipuft`` command, ``--help`` too) must not import torch."""
    code = "import sys, ipuft_lion; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
