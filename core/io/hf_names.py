"""Hugging Face parameter names ↔ ipuft units, through each component's own ``hf_mapping``, and the tensors
that stack several of a unit's variables (its optional ``hf_fused``, :class:`~ipuft.components.FusedRows`),
split at import and stacked again at export.

Generic machinery only: the names themselves live in the component plugins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ipuft.components import FusedRows, HasFusedTensors, HasHFConfig, Merges, exportable
from ipuft.program import Unit

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

    from ipuft.families import ModelFamily

# The largest safetensors file ``export`` writes, as transformers' ``save_pretrained`` shards by default.
DEFAULT_SHARD_BYTES = 5 * 2**30


def unit_mappings(modules: Mapping[str, torch.nn.Module], layers: int) -> dict[Unit, dict[str, str]]:
    """For every unit, its local variable names mapped to Hugging Face names."""
    out = {Unit("embeddings"): modules["embeddings"].hf_mapping(None)}
    for n in range(layers):
        out[Unit("decoder", n)] = modules["decoder"].hf_mapping(n)
    out[Unit("head")] = modules["head"].hf_mapping(None)
    return out


def unit_fused(modules: Mapping[str, torch.nn.Module], layers: int) -> dict[Unit, tuple[FusedRows, ...]]:
    """For every unit, the Hugging Face tensors that stack several of its variables (its component's
    ``hf_fused(layer)``; none where the component has no such method)."""
    def fused(role: str, layer: int | None) -> tuple[FusedRows, ...]:
        module = modules[role]
        return tuple(module.hf_fused(layer)) if isinstance(module, HasFusedTensors) else ()

    out = {Unit("embeddings"): fused("embeddings", None)}
    for n in range(layers):
        out[Unit("decoder", n)] = fused("decoder", n)
    out[Unit("head")] = fused("head", None)
    return out


def file_names(names: set[str], fused: tuple[FusedRows, ...]) -> set[str]:
    """Hugging Face names ``names`` as the files hold them: each fused tensor's parts replaced by the tensor."""
    parts = {p for f in fused for p in f.parts}
    return (names - parts) | {f.name for f in fused if set(f.parts) <= names}


def split_rows(fused: FusedRows, tensor: torch.Tensor, shapes: Mapping[str, tuple[int, ...]],
               source: str) -> dict[str, torch.Tensor]:
    """Fused ``tensor`` cut into its parts (each a copy, of its shape in ``shapes``); one line naming it (after
    ``source``) when its shape is not the parts' rows stacked."""
    from ipuft.errors import CheckpointError

    rows = [shapes[p][0] for p in fused.parts]
    rest = {tuple(shapes[p][1:]) for p in fused.parts}
    expected = (sum(rows), *next(iter(rest)))
    if len(rest) != 1 or tuple(tensor.shape) != expected or any(r % fused.groups for r in rows):
        sizes = " + ".join(f"{p.rsplit('.', 2)[-2] if '.' in p else p} {r}" for p, r in zip(fused.parts, rows))
        raise CheckpointError(f"{source}: {fused.name} has shape {tuple(tensor.shape)}, the model expects "
                              f"{expected} ({sizes} rows{f' in {fused.groups} groups' if fused.groups > 1 else ''})")
    blocks = tensor.reshape(fused.groups, -1, *expected[1:])
    pieces = blocks.split([r // fused.groups for r in rows], dim=1)
    return {p: piece.reshape(shapes[p]).clone() for p, piece in zip(fused.parts, pieces)}


def stack_rows(fused: FusedRows, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The fused tensor of parts ``tensors`` (by Hugging Face name): the inverse of :func:`split_rows`."""
    import torch

    parts = [tensors[p] for p in fused.parts]
    blocks = [t.reshape(fused.groups, -1, *t.shape[1:]) for t in parts]
    return torch.cat(blocks, dim=1).reshape(-1, *parts[0].shape[1:])


def export_names(modules: Mapping[str, torch.nn.Module], variables: Mapping[str, list], cfg: DictConfig,
                 family: ModelFamily) -> dict[str, str]:
    """``{"<unit>.<variable>": hf_name}`` of every variable an export writes, after checking that the result is
    a complete model of ``family`` (``cfg``'s shapes); a :class:`~ipuft.errors.PluginError` naming the first
    problem otherwise.

    Refused: a component that declares itself not exportable (``hf_exportable = False``); a variable with no
    Hugging Face name, unless it is ``added`` and its component folds it into the named ones (``hf_merge``,
    as a LoRA adapter is merged); two variables under one name; names missing from, or foreign to, the family.
    """
    from ipuft.errors import PluginError

    layers, kind = cfg.model.layers, family.title
    for role, module in modules.items():
        if not exportable(module):
            raise PluginError(f"model.{role}: {type(module).__name__} is not exportable to a Hugging Face {kind} "
                              f"(it sets hf_exportable = False)")
    names: dict[str, str] = {}
    owner: dict[str, str] = {}
    fused = unit_fused(modules, layers)
    for unit, mapping in unit_mappings(modules, layers).items():
        role = unit.role
        for spec in variables[role]:
            if spec.name in mapping:
                continue
            if not (spec.added and isinstance(modules[role], Merges)):
                raise PluginError(f"model.{role}: variable {spec.name} of {type(modules[role]).__name__} has no "
                                  f"Hugging Face name (hf_mapping){'' if spec.added else ' and is not added'}"
                                  f"{' and the component does not merge it (hf_merge)' if spec.added else ''}; "
                                  f"the export would lose it")
        for local, hf in mapping.items():
            if hf in owner:
                raise PluginError(f"{owner[hf]} and {unit}.{local} both map to the Hugging Face name {hf}; one "
                                  f"would overwrite the other")
            owner[hf] = f"{unit}.{local}"
            names[f"{unit}.{local}"] = hf
        for tensor in fused[unit]:
            if lacking := [p for p in tensor.parts if p not in mapping.values()]:
                raise PluginError(f"model.{role}: {type(modules[role]).__name__}'s hf_fused stacks {lacking[0]} into "
                                  f"{tensor.name}, but no variable of {unit} has that name (hf_mapping)")
    written = file_names(set(owner), tuple(f for group in fused.values() for f in group))
    expected = family.parameter_names(cfg)
    missing, foreign = sorted(expected - written), sorted(written - expected)
    if missing or foreign:
        what = f"lacks {', '.join(missing[:3])}" if missing else f"has {', '.join(foreign[:3])}, not {kind}'s"
        raise PluginError(f"the export would not be a complete {kind}: it {what}"
                          f"{' ...' if len(missing or foreign) > 3 else ''}")
    return names


def component_hf_config(modules: Mapping[str, torch.nn.Module], family: ModelFamily) -> dict:
    """What the components contribute to config.json (each module's optional ``hf_config()``); a
    :class:`~ipuft.errors.PluginError` when a component leaves out a key only it knows (the family's
    ``component_keys``)."""
    from ipuft.errors import PluginError

    out: dict = {}
    for role, module in modules.items():
        contributed = module.hf_config() if isinstance(module, HasHFConfig) else {}
        for key in family.component_keys.get(role, ()):
            if key not in contributed:
                raise PluginError(f"model.{role}: {type(module).__name__} does not give config.json's {key} "
                                  f"(hf_config()), so the export cannot say how to run it")
        out.update(contributed)
    return out
