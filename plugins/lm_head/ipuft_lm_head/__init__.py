"""The GPT-J language-model head: final layer norm, untied projection with bias, mean cross-entropy.

This module holds the hooks only and imports no torch, so that discovering the plugin (``ipuft --help``)
stays fast; the module itself is in :mod:`ipuft_lm_head.module`, imported when a run builds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.components import ComponentRegistry, VariableSpec
from ipuft.program import Op, Phase, Stage, StepProgram
from ipuft.sharding import VOCAB_SHARDED, ShardSpec

if TYPE_CHECKING:
    from ipuft_lm_head.module import GPTJLMHead

NAME = "gptj"


def build(cfg: DictConfig) -> GPTJLMHead:
    from ipuft_lm_head.module import GPTJLMHead

    m = cfg.model
    return GPTJLMHead(m.hidden_size, m.embedding.vocab_size, m.layer_norm_epsilon, cfg.execution.tensor_parallel)


@hookimpl
def ipuft_register_components(registry: ComponentRegistry) -> None:
    registry.add("head", NAME, build, "GPT-J LM head: ln_f, untied projection with bias, mean cross-entropy")


@hookimpl
def ipuft_shard_spec(role: str, name: str, variables: list[VariableSpec], tensor_parallel: int):
    if (role, name) != ("head", NAME):
        return None
    return {"norm.weight": ShardSpec(), "norm.bias": ShardSpec(),
            "proj.weight": VOCAB_SHARDED, "proj.bias": VOCAB_SHARDED}


@hookimpl
def ipuft_emit_phases(program: StepProgram, role: str, name: str):
    if (role, name) != ("head", NAME):
        return None
    program.emit(Stage.HEAD_FORWARD_BACKWARD, Phase("head", None, (Op.LOSS_BACKWARD,)))
    program.emit(Stage.HEAD_OPTIMIZER, Phase("head", None, (Op.OPTIMIZER_STEP,)))
    return True
