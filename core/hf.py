"""Hugging Face parameter names ↔ ipuft units, through each component's own ``hf_mapping``.

Generic machinery only: the names themselves live in the component plugins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ipuft.errors import IpuftError

if TYPE_CHECKING:
    import torch

# The largest safetensors file ``export`` writes, as transformers' ``save_pretrained`` shards by default.
DEFAULT_SHARD_BYTES = 5 * 2**30


def unit_mappings(modules: Mapping[str, torch.nn.Module], layers: int) -> dict[str, dict[str, str]]:
    """For every unit, its local variable names mapped to Hugging Face names."""
    out = {"embeddings": modules["embeddings"].hf_mapping(None)}
    for n in range(layers):
        out[f"decoder.{n}"] = modules["decoder"].hf_mapping(n)
    out["head"] = modules["head"].hf_mapping(None)
    return out


def from_hf(
    modules: Mapping[str, torch.nn.Module], layers: int, hf_state: Mapping[str, torch.Tensor]
) -> dict[str, dict[str, torch.Tensor]]:
    """Split a Hugging Face state dict into per-unit variables; every mapped name must be present."""
    units: dict[str, dict[str, torch.Tensor]] = {}
    for unit, mapping in unit_mappings(modules, layers).items():
        missing = [hf for hf in mapping.values() if hf not in hf_state]
        if missing:
            raise IpuftError(f"Hugging Face weights lack {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        units[unit] = {local: hf_state[hf] for local, hf in mapping.items()}
    return units


def to_hf(
    modules: Mapping[str, torch.nn.Module], layers: int, units: Mapping[str, Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Per-unit variables as one Hugging Face state dict."""
    out = {}
    for unit, mapping in unit_mappings(modules, layers).items():
        for local, hf in mapping.items():
            out[hf] = units[unit][local]
    return out
