"""Hugging Face parameter names ↔ ipuft units, through each component's own ``hf_mapping``.

Generic machinery only: the names themselves live in the component plugins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

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
