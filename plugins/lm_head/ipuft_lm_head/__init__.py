"""The GPT-J language-model head: final layer norm, untied projection with bias, mean cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.components import IGNORE_INDEX, ComponentRegistry, Init, VariableSpec, specs_from_module
from ipuft.program import Op, Phase, Stage, StepProgram
from ipuft.sharding import ShardSpec

NAME = "gptj"
VOCAB_PAD_MULTIPLE = 16


class GPTJLMHead(torch.nn.Module):
    """``hidden[B, T, H] -> logits[B, T, V]``, or the mean loss when ``labels[B, T]`` are given."""

    def __init__(self, hidden_size: int, vocab_size: int, layer_norm_epsilon: float = 1e-5) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden_size, eps=layer_norm_epsilon)
        self.proj = torch.nn.Linear(hidden_size, vocab_size)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.proj(self.norm(hidden))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX)

    def variable_specs(self) -> list[VariableSpec]:
        inits = {"norm.weight": Init("ones"), "norm.bias": Init("zeros"),
                 "proj.weight": Init("normal", 0.02), "proj.bias": Init("zeros")}
        return specs_from_module(self, inits)

    def hf_mapping(self, layer: int | None = None) -> dict[str, str]:
        return {"norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias",
                "proj.weight": "lm_head.weight", "proj.bias": "lm_head.bias"}


def build(cfg: DictConfig) -> GPTJLMHead:
    m = cfg.model
    return GPTJLMHead(m.hidden_size, m.embedding.vocab_size, m.layer_norm_epsilon)


@hookimpl
def ipuft_register_components(registry: ComponentRegistry) -> None:
    registry.add("head", NAME, build, "GPT-J LM head: ln_f, untied projection with bias, mean cross-entropy")


@hookimpl
def ipuft_shard_spec(role: str, name: str, variables: list[VariableSpec], tensor_parallel: int):
    if (role, name) != ("head", NAME):
        return None
    vocab = ShardSpec(tp_dim=0, pad_multiple=VOCAB_PAD_MULTIPLE)
    return {"norm.weight": ShardSpec(), "norm.bias": ShardSpec(), "proj.weight": vocab, "proj.bias": vocab}


@hookimpl
def ipuft_emit_phases(program: StepProgram, role: str, name: str):
    if (role, name) != ("head", NAME):
        return None
    program.emit(Stage.HEAD_FORWARD_BACKWARD, Phase("head", None, (Op.LOSS_BACKWARD,)))
    program.emit(Stage.HEAD_OPTIMIZER, Phase("head", None, (Op.OPTIMIZER_STEP,)))
    return True
