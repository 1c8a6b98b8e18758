"""The GPT-J decoder block's ipuft hooks.

This module imports no torch, so that discovering the plugin (``ipuft --help``) stays fast; the block itself
is in :mod:`ipuft_decoder.block`, imported when a run builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ipuft import hookimpl
from ipuft.components import ComponentRegistry, VariableSpec
from ipuft.config import ConfigSectionRegistry
from ipuft.program import Op, Phase, Stage, StepProgram
from ipuft.sharding import ShardSpec

if TYPE_CHECKING:
    from ipuft_decoder.block import GPTJDecoderBlock

NAME = "gptj"
SECTION = "gptj_decoder"

__all__ = ["DecoderOptions"]


class AttentionKernel(str, Enum):
    sdpa = "sdpa"  # torch.nn.functional.scaled_dot_product_attention
    eager = "eager"  # explicit matmul-softmax-matmul, as Hugging Face's eager path


@dataclass
class DecoderOptions:
    """``plugins.gptj_decoder``: options of the GPT-J decoder block."""

    attention_kernel: AttentionKernel = AttentionKernel.sdpa


def build(cfg: DictConfig) -> GPTJDecoderBlock:
    """One layer with this tensor-parallel rank's share of the heads and of the MLP width."""
    from ipuft_decoder.block import GPTJDecoderBlock

    m, tp = cfg.model, cfg.execution.tensor_parallel
    return GPTJDecoderBlock(
        hidden_size=m.hidden_size,
        heads=m.attention.heads // tp,
        head_dim=m.hidden_size // m.attention.heads,
        intermediate_size=m.intermediate_size // tp,
        rotary_dim=m.attention.rotary_dim,
        rotary_base=m.attention.rotary_positional_embeddings_base,
        layer_norm_epsilon=m.layer_norm_epsilon,
        dropout_prob=m.dropout_prob,
        attention_kernel=cfg.plugins[SECTION].attention_kernel.value,
    )


@hookimpl
def ipuft_register_components(registry: ComponentRegistry) -> None:
    registry.add("decoder", NAME, build, "GPT-J block: parallel attention (interleaved rotary) and gelu_new MLP")


@hookimpl
def ipuft_register_config_sections(registry: ConfigSectionRegistry) -> None:
    registry.add(SECTION, DecoderOptions)


@hookimpl
def ipuft_shard_spec(role: str, name: str, variables: list[VariableSpec], tensor_parallel: int):
    if (role, name) != ("decoder", NAME):
        return None
    column, row, replicated = ShardSpec(tp_dim=0), ShardSpec(tp_dim=1), ShardSpec()
    return {
        "norm.weight": replicated,
        "norm.bias": replicated,
        # Attention is sharded by heads: q, k, v by output rows, out_proj by input columns.
        "attn.q_proj.weight": column,
        "attn.k_proj.weight": column,
        "attn.v_proj.weight": column,
        "attn.out_proj.weight": row,
        "mlp.fc_in.weight": column,
        "mlp.fc_in.bias": column,
        "mlp.fc_out.weight": row,
        # Added once, after the all-reduce that attention and MLP share.
        "mlp.fc_out.bias": replicated,
    }


@hookimpl
def ipuft_emit_phases(program: StepProgram, role: str, name: str):
    if (role, name) != ("decoder", NAME):
        return None
    layers = range(program.layers)
    for n in layers:
        program.emit(Stage.DECODER_FORWARD, Phase("decoder", n, (Op.FORWARD,)))
    for n in reversed(layers):
        program.emit(Stage.DECODER_BACKWARD, Phase("decoder", n, (Op.BACKWARD,)))
    for n in layers:
        program.emit(Stage.DECODER_OPTIMIZER, Phase("decoder", n, (Op.OPTIMIZER_STEP,)))
    return True
