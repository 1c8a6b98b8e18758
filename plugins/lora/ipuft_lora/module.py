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

from ipuft.components import HasFusedTensors, Init, VariableSpec
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

    def _fused_targets(self, layer: int | None) -> dict:
        """Each fused Hugging Face tensor (:class:`ipuft.components.FusedRows`, Phi-3's ``qkv_proj``) that holds a
        targeted projection: its targeted paths, in row order. peft adapts the fused module as one."""
        names = super().hf_mapping(layer)
        fused = self.hf_fused(layer) if isinstance(self, HasFusedTensors) else ()
        out = {}
        for tensor in fused:
            paths = [p for part in tensor.parts for p in self.lora_paths if names[f"{p}.weight"] == part]
            if paths:
                out[tensor] = paths
        return out

    def peft_mapping(self, layer: int | None) -> dict[str, str]:
        """Each adapter's name in a peft adapter_model.safetensors: its projection's Hugging Face module under
        ``base_model.model.``, then ``lora_A.weight`` or ``lora_B.weight``; the adapters of a fused tensor's parts
        are written stacked instead (:meth:`peft_stacked`)."""
        names = super().hf_mapping(layer)
        stacked = {p for paths in self._fused_targets(layer).values() for p in paths}
        out = {}
        for path in self.lora_paths:
            if path in stacked:
                continue
            module = names[f"{path}.weight"].removesuffix(".weight")
            out.update({f"{path}.lora_A": f"base_model.model.{module}.lora_A.weight",
                        f"{path}.lora_B": f"base_model.model.{module}.lora_B.weight"})
        return out

    def peft_stacked(self, layer: int | None) -> dict[str, list[str]]:
        """The peft tensors of the fused modules' adapters, each with the variables it is made of: one adapter
        of rank ``m · rank`` on the fused module for its ``m`` targeted parts, ``A`` their A's stacked and ``B``
        block-diagonal (each part's B at its rows and its A's columns, zeros elsewhere), so that ``B A x``
        is every part's own update: exact, with ``lora_alpha`` scaled alike (``peft_config``'s patterns)."""
        out = {}
        for tensor, paths in self._fused_targets(layer).items():
            module = f"base_model.model.{tensor.name.removesuffix('.weight')}"
            out[f"{module}.lora_A.weight"] = [f"{p}.lora_A" for p in paths]
            out[f"{module}.lora_B.weight"] = [f"{p}.lora_B" for p in paths]
        return out

    def peft_stack(self, layer: int | None, name: str, tensors: dict[str, torch.Tensor],
                   shapes: dict[str, tuple[int, ...]]) -> torch.Tensor:
        """peft tensor ``name`` of :meth:`peft_stacked` from its variables ``tensors``; ``shapes``: the unit's
        variables' whole shapes (a part's rows, targeted or not)."""
        names = super().hf_mapping(layer)
        for tensor, paths in self._fused_targets(layer).items():
            module = f"base_model.model.{tensor.name.removesuffix('.weight')}"
            if name == f"{module}.lora_A.weight":
                return torch.cat([tensors[f"{p}.lora_A"] for p in paths])
            if name != f"{module}.lora_B.weight":
                continue
            local = {hf: n.removesuffix(".weight") for n, hf in names.items() if n.endswith(".weight")}
            rows = [shapes[f"{local[part]}.weight"][0] for part in tensor.parts]
            rank = self.lora_options.rank
            first = tensors[f"{paths[0]}.lora_B"]
            out = torch.zeros(sum(rows), rank * len(paths), dtype=first.dtype)
            for i, path in enumerate(paths):
                start = sum(rows[: tensor.parts.index(names[f"{path}.weight"])])
                b = tensors[f"{path}.lora_B"]
                out[start : start + b.shape[0], i * rank : (i + 1) * rank] = b
            return out
        raise KeyError(name)

    def peft_config(self) -> dict:
        """The adapter's part of a peft adapter_config.json: a fused module adapted for ``m`` of its parts has
        rank ``m · rank`` and alpha ``m · alpha`` (``rank_pattern``, ``alpha_pattern``), its scale unchanged."""
        o = self.lora_options
        modules = {p.rsplit(".", 1)[-1] for p in self.lora_paths}
        ranks, alphas = {}, {}
        for tensor, paths in self._fused_targets(0).items():
            leaf = tensor.name.removesuffix(".weight").rsplit(".", 1)[-1]
            modules = (modules - {p.rsplit(".", 1)[-1] for p in paths}) | {leaf}
            ranks[leaf], alphas[leaf] = o.rank * len(paths), o.alpha * len(paths)
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": o.rank, "lora_alpha": o.alpha,
                "lora_dropout": o.dropout, "target_modules": sorted(modules), "rank_pattern": ranks,
                "alpha_pattern": alphas, "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
                "inference_mode": True, "modules_to_save": None, "use_rslora": False, "use_dora": False}


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
