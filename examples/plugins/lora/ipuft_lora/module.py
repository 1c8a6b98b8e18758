"""The LoRA decoder block: ipuft's GPT-J block with its targeted projections wrapped."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from ipuft.components import Init, VariableSpec
from ipuft_decoder import block_arguments
from ipuft_decoder.block import GPTJDecoderBlock
from ipuft_lora import LoRAOptions

ADAPTERS = (".lora_A", ".lora_B")


class LoRALinear(nn.Module):
    """``W x (+ b) + scale · B A dropout(x)``: a frozen ``nn.Linear``'s parameters plus the adapter's."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, dropout: float) -> None:
        super().__init__()
        self.weight = base.weight
        self.bias = base.bias
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.empty(base.out_features, rank))
        self.scale, self.dropout = scale, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapter = F.linear(F.linear(F.dropout(x, self.dropout, self.training), self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + self.scale * adapter


class LoRADecoderBlock(GPTJDecoderBlock):
    """The stock block with its targeted projections replaced by :class:`LoRALinear`. Variable names are the
    stock ones (so its Hugging Face mapping holds for the base) plus ``<projection>.lora_A`` and ``.lora_B``."""

    def __init__(self, options: LoRAOptions, **arguments) -> None:
        super().__init__(**arguments)
        self.options = options
        self.scale = options.alpha / options.rank
        self.targets = []
        for path, module in list(self.named_modules()):
            if path.rsplit(".", 1)[-1] in options.targets and isinstance(module, nn.Linear):
                parent, _, leaf = path.rpartition(".")
                wrapped = LoRALinear(module, options.rank, self.scale, options.dropout)
                setattr(self.get_submodule(parent), leaf, wrapped)
                self.targets.append(path)

    @classmethod
    def from_config(cls, cfg: DictConfig, options: LoRAOptions) -> LoRADecoderBlock:
        return cls(options, **block_arguments(cfg))

    def variable_specs(self) -> list[VariableSpec]:
        """The stock variables, frozen; the adapters trainable and ``added`` (A: normal, std 1/rank; B: zeros)."""
        specs = []
        for v in super().variable_specs():
            if v.name.endswith(".lora_A"):
                specs.append(replace(v, init=Init("normal", 1.0 / self.options.rank), added=True))
            elif v.name.endswith(".lora_B"):
                specs.append(replace(v, init=Init("zeros"), added=True))
            else:
                specs.append(replace(v, trainable=False))
        return specs

    def hf_mapping(self, layer: int | None) -> dict[str, str]:
        """The stock names; the adapters have none (export merges them)."""
        return {k: v for k, v in super().hf_mapping(layer).items() if not k.endswith(ADAPTERS)}

    def hf_merge(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The unit's variables for a plain GPT-J: each targeted weight with its adapter folded in,
        ``W + scale · B A`` (computed in float32), and no adapter."""
        out = {k: t for k, t in tensors.items() if not k.endswith(ADAPTERS)}
        for path in self.targets:
            weight = out[f"{path}.weight"]
            delta = tensors[f"{path}.lora_B"].float() @ tensors[f"{path}.lora_A"].float()
            out[f"{path}.weight"] = (weight.float() + self.scale * delta).to(weight.dtype)
        return out
