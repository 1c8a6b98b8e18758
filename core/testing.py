"""Helpers for testing ipuft plugins: install a module as a plugin through a real entry point, and check that
training through the engine equals a plain autograd reference.

This module is a pytest plugin, registered through the ``pytest11`` entry point of the ipuft distribution:
wherever ipuft is installed, a test may ask for the :func:`install_plugin` fixture without any
``conftest.py`` (``pytest -p no:ipuft`` turns it off; with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` set, load it
with ``-p ipuft.testing``). :func:`assert_parity` is a plain function. Nothing here imports torch until a
helper runs, so loading the plugin costs a pytest session (of any project) next to nothing.

```python
from ipuft.testing import assert_parity

def test_my_optimizer(install_plugin):
    hooks = install_plugin("my_package", name="my_sgd")          # a real entry-point lookup
    m = {}
    def update(name, p, g, lr, step):                             # the rule, written out plainly
        m[name] = 0.9 * m.get(name, 0) + g
        p -= lr * m[name]
    assert_parity(hooks, ["training.optimizer.name=my_sgd"], update, steps=5, rtol=1e-5)
```
"""

from __future__ import annotations

import math
import os
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

    from ipuft.plugins import PluginHooks

ENTRY_POINT_GROUP = "ipuft"  # ipuft.hookspecs.PROJECT, without importing pluggy at pytest's start


def write_distribution(root: Path, name: str, entry_points: Mapping[str, str], version: str = "0.1.0") -> Path:
    """Write a ``*.dist-info`` into ``root`` declaring ``entry_points`` (name → module) in the ``ipuft`` group;
    with ``root`` on ``sys.path``, ``importlib.metadata`` finds it like an installed distribution."""
    info = Path(root) / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "\n".join(f"{ep} = {module}" for ep, module in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}\n")
    return info


class PluginInstaller:
    """Installs plugins for one test through real entry points: a temporary ``*.dist-info`` on ``sys.path``
    (and on ``PYTHONPATH``, so that processes the test starts find it too), undone by ``monkeypatch``."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = Path(root)
        self.monkeypatch = monkeypatch
        self._on_path: set[str] = set()

    def add_path(self, path: str | os.PathLike) -> None:
        """Put ``path`` first on ``sys.path`` and ``PYTHONPATH`` for the rest of the test."""
        path = str(path)
        if path in self._on_path:
            return
        self._on_path.add(path)
        self.monkeypatch.syspath_prepend(path)
        self.monkeypatch.setenv("PYTHONPATH", os.pathsep.join([path, *filter(None, [os.environ.get("PYTHONPATH")])]))

    def distribution(self, name: str, entry_points: Mapping[str, str], modules: Mapping[str, str] | None = None,
                     version: str = "0.1.0") -> None:
        """Declare distribution ``name`` with ``entry_points`` (entry-point name → module). ``modules`` are
        module sources (name → source, dedented) written beside it; a module of that name imported earlier
        is forgotten, so the new source is the one loaded."""
        self.add_path(self.root)
        write_distribution(self.root, name, entry_points, version)
        for module, source in (modules or {}).items():
            (self.root / f"{module}.py").write_text(textwrap.dedent(source))
            sys.modules.pop(module, None)

    def __call__(self, module: str | ModuleType, name: str | None = None, *, distribution: str | None = None,
                 path: str | os.PathLike | None = None, source: str | None = None,
                 version: str = "0.1.0") -> PluginHooks:
        """Install ``module`` (a module or its dotted name) as plugin ``name`` (default: the module's name with
        dots as underscores) and return a fresh :class:`ipuft.plugins.PluginHooks` that discovered it.

        ``path``: a directory to import the module from (a plugin's source tree, when it is not installed);
        ``source``: the module's source, written into a temporary file. If an installed distribution already
        declares exactly this entry point (``pip install -e`` of the plugin under test), it is used as it is.
        """
        from ipuft.plugins import create_plugin_manager

        module_name = module if isinstance(module, str) else module.__name__
        name = name or module_name.replace(".", "_")
        if path is not None:
            self.add_path(path)
        installed = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if source is not None or not any(ep.value == module_name for ep in installed):
            dist = distribution or f"ipuft-testing-{name.replace('_', '-')}"
            self.distribution(dist, {name: module_name}, {module_name: source} if source is not None else None,
                              version)
        return create_plugin_manager()


@pytest.fixture
def install_plugin(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> PluginInstaller:
    """``install_plugin(module, name=None, *, distribution=None, path=None, source=None)`` installs a module as
    an ipuft plugin through a real entry point for this test and returns a fresh ``PluginHooks``;
    ``install_plugin.distribution(name, entry_points, modules)`` declares several at once."""
    return PluginInstaller(tmp_path_factory.mktemp("ipuft-plugins"), monkeypatch)


# ---- parity with a plain autograd reference ---------------------------------------------------------------

# update(name, param, grad, lr, step): apply the optimizer to ``param`` in place (float32, under no_grad), from
# the finished gradient (loss scale removed, clipping applied), at learning rate ``lr`` and update ``step``
# (counted from 1). ``name`` is the variable's Hugging Face name, or ``<unit>.<local name>`` if it has none.
Update = Callable[[str, "torch.Tensor", "torch.Tensor", float, int], None]


@dataclass
class Parity:
    """What :func:`assert_parity` compared: per-step losses and global gradient norms, and the final weights
    (full, float32) by reference name, of the engine and of the reference."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    reference_losses: list[float] = field(default_factory=list)
    reference_grad_norms: list[float] = field(default_factory=list)
    reference_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    initial_weights: dict[str, torch.Tensor] = field(default_factory=dict)


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` over a tensor (in float64)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def reference_names(modules: Mapping[str, Any], layers: int, variables: Mapping[str, Sequence[Any]]
                    ) -> dict[tuple[str, str], str]:
    """``(unit, local name) -> name`` an update sees: the Hugging Face name where the component maps the
    variable, else ``<unit>.<local name>``."""
    from ipuft.io.hf_names import unit_mappings

    names = {}
    for unit, mapping in unit_mappings(modules, layers).items():
        for v in variables[unit.role]:
            names[(unit, v.name)] = mapping.get(v.name) or f"{unit}.{v.name}"
    return names


def assert_parity(hooks: PluginHooks, overrides: Sequence[str], update: Update, steps: int = 5, *,
                  preset: str = "tiny", rtol: float = 1e-5, require_change: bool = True) -> Parity:
    """Train ``steps`` optimizer steps through the engine, and the same steps with a plain reference, and
    assert that every step's loss and global gradient norm, and every final weight, agree within ``rtol``.

    The config is ``preset`` with ``overrides`` and ``training.steps=steps`` (so the learning-rate schedule
    is the run's). The reference is one process of plain autograd: each micro-batch runs the components'
    own modules in turn (``torch.func.functional_call`` with float32 leaf tensors that start from the
    engine's initial weights: embeddings, every decoder layer, the head's loss), its loss times ``S / GA``
    is back-propagated (``S`` the loss scale, ``GA`` the micro-batches), and then every gradient is finished
    as core does, ``g · (1/S) · C / max(N, C)`` (``N`` the global norm of the unscaled gradient, ``C``
    ``training.optimizer.gradient_clipping``), and handed to ``update``. Weights are compared by
    ``max |engine - reference| / max |reference|`` per variable. With ``require_change`` every variable
    must also have moved from its initial value (a rule that updates nothing would otherwise agree).

    The run must be one process (``execution.data_parallel`` and ``tensor_parallel`` 1) without dropout, and
    the engine must skip no step (the reference keeps the initial loss scale; a skip fails the comparison).
    In ``model.precision`` other than float32 the engine rounds and the reference does not: pass a
    tolerance to match. Returns what was compared, for further checks.
    """
    import torch

    from ipuft.config import load_config
    from ipuft.data.tokens import data_source
    from ipuft.engine.model import build_model
    from ipuft.engine.scaling import LossScale
    from ipuft.run.runtime import build_engine
    from ipuft.run.schedule import learning_rate

    cfg = load_config(preset, [*overrides, f"training.steps={steps}"], hooks.registrations.config_sections)
    if cfg.execution.data_parallel != 1 or cfg.execution.tensor_parallel != 1:
        raise ValueError("assert_parity runs one process: set execution.data_parallel=1 and "
                         "execution.tensor_parallel=1")
    if cfg.model.dropout_prob:
        raise ValueError("assert_parity needs model.dropout_prob=0: the reference cannot draw the engine's masks")
    data = data_source(cfg)
    gbs, mbs = cfg.training.global_batch_size, cfg.execution.micro_batch_size
    batches = [data.batch(s, gbs, mbs) for s in range(steps)]
    lrs = [learning_rate(s, steps, cfg.training.optimizer.learning_rate) for s in range(steps)]

    engine = build_engine(cfg, hooks)
    parts = build_model(cfg, hooks)  # the reference's own modules (on the meta device; weights come as arguments)
    for module in parts.modules.values():
        module.train()
    layers, units = cfg.model.layers, engine.program.units()
    names = reference_names(parts.modules, layers, parts.variables)
    initial = engine.model.full_weights()
    result = Parity(initial_weights={names[(u, n)]: t.float().clone() for u, w in initial.items()
                                     for n, t in w.items()})
    params = {u: {n: t.detach().float().clone().requires_grad_() for n, t in w.items()} for u, w in initial.items()}

    scale, clipping = LossScale.from_config(cfg).scale, cfg.training.optimizer.gradient_clipping
    for step, batch in enumerate(batches):
        r = engine.step(batch, lrs[step])
        if r.skipped:
            raise AssertionError(f"step {step + 1}: the engine skipped the update (loss {r.loss!r}, gradient norm "
                                 f"{r.grad_norm!r}); the reference never skips")
        result.losses.append(r.loss)
        result.grad_norms.append(r.grad_norm)
        loss, norm = _reference_step(parts.modules, params, batch, layers, scale)
        result.reference_losses.append(loss)
        result.reference_grad_norms.append(norm)
        _check(step, "loss", r.loss, loss, rtol)
        _check(step, "global gradient norm", r.grad_norm, norm, rtol)
        factor = (1.0 / scale) * clipping / max(norm, clipping)
        with torch.no_grad():
            for unit in units:
                for n, p in params[unit].items():
                    update(names[(unit, n)], p, p.grad * factor, lrs[step], step + 1)
                    p.grad = None

    final = engine.model.full_weights()
    for unit in units:
        for n, t in final[unit].items():
            name = names[(unit, n)]
            result.weights[name] = t.float()
            result.reference_weights[name] = params[unit][n].detach()
    for name, w in result.weights.items():
        ref = result.reference_weights[name]
        difference = max_rel(w, ref)
        if not difference <= rtol:
            raise AssertionError(f"weight {name} after {steps} steps: max |engine - reference| / max |reference| = "
                                 f"{difference:.3g} > rtol {rtol:g}")
        if require_change and torch.equal(w, result.initial_weights[name]):
            raise AssertionError(f"weight {name} never changed in {steps} steps (pass require_change=False if "
                                 f"that is meant)")
    return result


def _reference_step(modules, params, batch, layers: int, scale: float) -> tuple[float, float]:
    """One step's forward and backward, micro-batch by micro-batch; returns the mean loss and the global norm
    of the unscaled gradient (the gradients stay in ``.grad``, carrying the loss scale)."""
    from torch.func import functional_call

    ga = batch.micro_batches
    losses = []
    for mb in range(ga):
        h = functional_call(modules["embeddings"], params["embeddings"], (batch.input_ids[mb],))
        for n in range(layers):
            h = functional_call(modules["decoder"], params[f"decoder.{n}"], (h,))
        loss = functional_call(modules["head"], params["head"], (h, batch.labels[mb]))
        (loss * (scale / ga)).backward()
        losses.append(loss.item())
    tensors = [p for unit in params.values() for p in unit.values()]
    for p in tensors:
        if p.grad is None:  # a variable the loss does not reach: a zero gradient, as the engine has
            p.grad = p.detach().new_zeros(p.shape)
    squares = sum(float((p.grad.double() / scale).pow(2).sum()) for p in tensors)
    return sum(losses) / ga, math.sqrt(squares)


def _check(step: int, what: str, engine: float, reference: float, rtol: float) -> None:
    difference = abs(engine - reference) / max(abs(reference), 1e-12)
    if not difference <= rtol:
        raise AssertionError(f"step {step + 1}: engine {what} {engine!r} against the reference's {reference!r} "
                             f"(relative difference {difference:.3g} > rtol {rtol:g})")
