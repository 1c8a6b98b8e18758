"""LoRA on a built component: adapters on its targeted projections (:func:`add_adapters`), every base variable
frozen (:func:`freeze`).

An adapter is two parameters registered on the projection itself, an :class:`ipuft.ops.Linear`
(``<path>.lora_A`` ``[rank, in]`` and ``<path>.lora_B`` ``[out, rank]``, so that they are the component's
variables and the engine binds them like any other), and :class:`LoRAAdapter` as the projection's ``adapter``,
which the projection adds to its output however the block calls it. The component keeps its class's
behaviour; its instance becomes a subclass that also describes the adapters (variable specs, shard specs, the
merged and the peft export).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ipuft.components import Init, VariableSpec
from ipuft.errors import PluginError
from ipuft.ops import Linear, linear
from ipuft.parallel import copy_to_tensor_parallel
from ipuft.sharding import COLUMN, REPLICATED, ROW, ShardSpec
from ipuft_lora import ROW_PARALLEL, LoRAOptions

ADAPTERS = (".lora_A", ".lora_B")
# How each kind of projection's adapter splits over TP: (A, B), and whether each one's gradient is partial on a
# rank (summed over TP by copy_to_tensor_parallel on the weight).
LAYOUT = {"column": (REPLICATED, COLUMN), "row": (ROW, REPLICATED), "replicated": (REPLICATED, REPLICATED)}
PARTIAL = {"column": (True, False), "row": (False, True), "replicated": (True, True)}


class LoRAAdapter:
    """``scale · B A dropout(x)`` of a projection ``module`` holding ``lora_A`` and ``lora_B``: what
    :class:`ipuft.ops.Linear` adds to its output. ``kind`` is the projection's TP layout (``column``, ``row``, or
    ``replicated`` for key/value projections that every rank computes whole): it says which of A and B have a
    gradient partial on each rank, which the TP copy sums (the identity at TP=1)."""

    def __init__(self, scale: float, dropout: float, kind: str) -> None:
        self.scale, self.dropout, self.kind = scale, dropout, kind

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        a, b = module.lora_A, module.lora_B
        partial_a, partial_b = PARTIAL[self.kind]
        a = copy_to_tensor_parallel(a) if partial_a else a
        b = copy_to_tensor_parallel(b) if partial_b else b
        h = F.dropout(x, self.dropout, module.training) if self.dropout else x
        return linear(linear(h, a), b) * self.scale


class Frozen:
    """A component whose every variable is frozen (mixed in before the component's class)."""

    def variable_specs(self) -> list[VariableSpec]:
        return [replace(v, trainable=False) for v in super().variable_specs()]


class LoRAComponent:
    """A component with LoRA adapters on ``lora_paths`` (mixed in before its class): its own variables frozen,
    the adapters trainable and ``added``."""

    lora_paths: dict[str, str]  # the projection's path: its TP kind
    lora_options: LoRAOptions

    @property
    def uses_dropout(self) -> bool:
        """Whether the adapters draw dropout masks, which the engine then seeds alike in a layer's forward and
        its recompute (:meth:`ipuft.engine.compute.UnitCompute.rng`)."""
        return self.lora_options.dropout > 0

    @property
    def lora_scale(self) -> float:
        return self.lora_options.alpha / self.lora_options.rank

    def variable_specs(self) -> list[VariableSpec]:
        """The component's variables, frozen; each A Kaiming-uniform (on ``±1/√in``, peft's default) and each B
        zeros, both ``added``."""
        specs = []
        for v in super().variable_specs():
            if v.name.endswith(".lora_A"):
                specs.append(replace(v, init=Init("uniform", 1.0 / math.sqrt(3 * v.shape[1])), trainable=True,
                                     added=True))
            elif v.name.endswith(".lora_B"):
                specs.append(replace(v, init=Init("zeros"), trainable=True, added=True))
            else:
                specs.append(replace(v, trainable=False))
        return specs

    def adapter_shard_specs(self, base: dict[str, ShardSpec]) -> dict[str, ShardSpec]:
        """Each adapter split as its projection is (see :data:`LAYOUT`), after checking that the projection's
        layout is the one its adapter computes for."""
        out = {}
        for path, kind in self.lora_paths.items():
            spec = base[f"{path}.weight"]
            if spec.tp_dim != {"column": 0, "row": 1, "replicated": None}[kind] or spec.pad_multiple is not None:
                raise PluginError(f"LoRA on {path}: its weight's shard spec {spec} is not the {kind}-parallel "
                                  f"layout its adapter computes for")
            out[f"{path}.lora_A"], out[f"{path}.lora_B"] = LAYOUT[kind]
        return out

    def hf_mapping(self, layer: int | None) -> dict[str, str]:
        """The component's names; the adapters have none (an export merges them, or writes them apart)."""
        return {k: v for k, v in super().hf_mapping(layer).items() if not k.endswith(ADAPTERS)}

    def hf_merge(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The unit's variables for a plain model: each targeted weight with its adapter folded in,
        ``W + scale · B A`` (computed in float32), and no adapter."""
        out = {k: t for k, t in tensors.items() if not k.endswith(ADAPTERS)}
        for path in self.lora_paths:
            weight = out[f"{path}.weight"]
            delta = tensors[f"{path}.lora_B"].float() @ tensors[f"{path}.lora_A"].float()
            out[f"{path}.weight"] = (weight.float() + self.lora_scale * delta).to(weight.dtype)
        return out

    def peft_mapping(self, layer: int | None) -> dict[str, str]:
        """Each adapter's name in a peft adapter_model.safetensors: its projection's Hugging Face module under
        ``base_model.model.``, then ``lora_A.weight`` or ``lora_B.weight``."""
        names = super().hf_mapping(layer)
        out = {}
        for path in self.lora_paths:
            module = names[f"{path}.weight"].removesuffix(".weight")
            out.update({f"{path}.lora_A": f"base_model.model.{module}.lora_A.weight",
                        f"{path}.lora_B": f"base_model.model.{module}.lora_B.weight"})
        return out

    def peft_config(self) -> dict:
        """The adapter's part of a peft adapter_config.json."""
        o = self.lora_options
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": o.rank, "lora_alpha": o.alpha,
                "lora_dropout": o.dropout, "target_modules": sorted({p.rsplit(".", 1)[-1] for p in self.lora_paths}),
                "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
                "modules_to_save": None, "use_rslora": False, "use_dora": False}


_CLASSES: dict[tuple[type, type], type] = {}


def _mixed(module: nn.Module, mixin: type) -> nn.Module:
    """``module`` as an instance of its class with ``mixin`` before it (one class per pair)."""
    base = type(module)
    if issubclass(base, mixin):
        return module
    if (base, mixin) not in _CLASSES:
        _CLASSES[(base, mixin)] = type(f"{mixin.__name__}[{base.__name__}]", (mixin, base), {})
    module.__class__ = _CLASSES[(base, mixin)]
    return module


def freeze(module: nn.Module) -> nn.Module:
    """``module`` with every variable frozen."""
    return _mixed(module, Frozen)


def add_adapters(module: nn.Module, targets: dict[str, str], options: LoRAOptions, tensor_parallel: int) -> nn.Module:
    """``module`` with a LoRA adapter on each of ``targets`` (``{target: module path}``), on the device and in the
    dtype of the projection's weight (the meta device, as core builds components)."""
    paths = {}
    for target, path in targets.items():
        proj = module.get_submodule(path)
        if not isinstance(proj, Linear):
            raise PluginError(f"LoRA on {path}: a {type(proj).__name__}, not an ipuft.ops.Linear, whose adapter "
                              f"its every call adds")
        kind = "row" if target in ROW_PARALLEL else "column"
        attention = module.get_submodule(path.rpartition(".")[0])
        if target in ("k", "v") and tensor_parallel > 1 and getattr(attention, "kv_replicated", False):
            kind = "replicated"  # every rank computes every key/value head (TP does not divide them)
        out_features, in_features = proj.weight.shape
        like = {"device": proj.weight.device, "dtype": proj.weight.dtype}
        proj.register_parameter("lora_A", nn.Parameter(torch.empty(options.rank, in_features, **like)))
        proj.register_parameter("lora_B", nn.Parameter(torch.empty(out_features, options.rank, **like)))
        proj.adapter = LoRAAdapter(options.alpha / options.rank, options.dropout, kind)
        paths[path] = kind
    module = _mixed(module, LoRAComponent)
    module.lora_paths, module.lora_options = paths, options
    return module
