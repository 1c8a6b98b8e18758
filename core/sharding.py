"""The sharding contract: how each variable of a component splits for tensor parallelism, and whether
it may be replica-sharded (RTS, ZeRO-style) over the data-parallel ranks.

A component plugin gives its components' specs with their registration (``registry.add(...,
shard_specs={name: spec})``), or, for a layout computed from the variables or the run's config, answers the
``ipuft_shard_spec`` hook (for its own components or other plugins'); core turns the answer into local
shapes and shards. :data:`COLUMN`, :data:`ROW`, :data:`REPLICATED` and :data:`VOCAB_SHARDED` are the layouts
the shipped components are made of. A component with no answer is fully replicated, which is only
allowed at ``tensor_parallel == 1``; :func:`replicated` states it explicitly, for a component every TP rank
computes whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ipuft.components import VariableSpec
from ipuft.errors import ConfigError, PluginError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ShardSpec:
    """How one variable is laid out over the tensor-parallel and data-parallel ranks.

    ``tp_dim``: the dimension split evenly over the TP group, or ``None`` when every TP rank holds a full
    replica (layer norms, a row-parallel layer's bias).
    ``pad_multiple``: when sharded, ``tp_dim`` is padded up to a multiple of ``tensor_parallel *
    pad_multiple`` first (the vocabulary, as the reference pads it); ``None``: it must divide evenly.
    ``rts``: whether the variable, its optimizer state and its gradient may be stored sharded over the
    data-parallel replicas.
    """

    tp_dim: int | None = None
    pad_multiple: int | None = None
    rts: bool = True

    @property
    def replicated_over_tp(self) -> bool:
        return self.tp_dim is None

    def padded_size(self, size: int, tensor_parallel: int) -> int:
        """The full size of ``tp_dim`` after padding for ``tensor_parallel`` shards."""
        if self.tp_dim is None or tensor_parallel == 1 or self.pad_multiple is None:
            return size
        multiple = tensor_parallel * self.pad_multiple
        return math.ceil(size / multiple) * multiple

    def local_shape(self, shape: tuple[int, ...], tensor_parallel: int) -> tuple[int, ...]:
        """The shape one TP rank holds."""
        if self.tp_dim is None or tensor_parallel == 1:
            return tuple(shape)
        padded = self.padded_size(shape[self.tp_dim], tensor_parallel)
        if padded % tensor_parallel:
            raise ConfigError(
                f"dimension {self.tp_dim} of size {shape[self.tp_dim]} does not split over "
                f"execution.tensor_parallel={tensor_parallel}"
            )
        local = list(shape)
        local[self.tp_dim] = padded // tensor_parallel
        return tuple(local)

    def shard(self, full: torch.Tensor, tp_rank: int, tensor_parallel: int) -> torch.Tensor:
        """The slice of ``full`` that TP rank ``tp_rank`` holds (padding with zeros where needed)."""
        if self.tp_dim is None or tensor_parallel == 1:
            return full
        size = full.shape[self.tp_dim]
        padded = self.padded_size(size, tensor_parallel)
        if padded != size:
            pad_shape = list(full.shape)
            pad_shape[self.tp_dim] = padded - size
            import torch  # here, not at the top: plugins import this module when they are discovered

            full = torch.cat([full, full.new_zeros(pad_shape)], dim=self.tp_dim)
        return full.chunk(tensor_parallel, dim=self.tp_dim)[tp_rank]

    def unshard(self, shards: list[torch.Tensor], full_size: int | None = None) -> torch.Tensor:
        """Reassemble the full variable from every TP rank's shard, dropping padding."""
        if self.tp_dim is None or len(shards) == 1:
            return shards[0]
        import torch

        full = torch.cat(shards, dim=self.tp_dim)
        if full_size is not None:
            full = full.narrow(self.tp_dim, 0, full_size)
        return full


# The layouts every shipped component is made of (torch ``Linear`` weights are ``[out, in]``):
# A column-parallel projection's weight (and bias): split by output rows, each rank computing its share of the
# outputs (q, k, v, an MLP's first projections).
COLUMN = ShardSpec(tp_dim=0)
# A row-parallel projection's weight: split by input columns, each rank's output partial until the all-reduce
# (attention's output projection, an MLP's last).
ROW = ShardSpec(tp_dim=1)
# Whole on every TP rank: norms, and a row-parallel projection's bias, added once after the all-reduce.
REPLICATED = ShardSpec()
# A vocabulary-indexed variable (embedding table, LM projection): rows sharded over TP, the vocabulary
# padded up to a multiple of TP × 16 first, as the reference pads it.
VOCAB_SHARDED = ShardSpec(tp_dim=0, pad_multiple=16)


def replicated(variables: list[VariableSpec]) -> dict[str, ShardSpec]:
    """Every variable whole on every TP rank (and RTS-shardable): for a component each TP rank computes in
    full, with no tensor-parallel collective."""
    return {v.name: REPLICATED for v in variables}


def resolve_shard_specs(
    component: str, variables: list[VariableSpec], answer: dict[str, ShardSpec] | None, tensor_parallel: int
) -> dict[str, ShardSpec]:
    """Check a plugin's answer to ``ipuft_shard_spec`` against the component's variables.

    Every variable needs a spec; with no answer at all, everything is replicated, which needs TP=1.
    """
    names = [v.name for v in variables]
    if answer is None:
        if tensor_parallel > 1:
            raise ConfigError(
                f"{component} declares no tensor-parallel sharding; set execution.tensor_parallel=1, or register "
                f"it with shard_specs (ipuft.sharding.REPLICATED for every variable if every TP rank computes it "
                f"whole)"
            )
        return {n: REPLICATED for n in names}
    missing = sorted(set(names) - set(answer))
    extra = sorted(set(answer) - set(names))
    if missing or extra:
        raise PluginError(
            f"{component}: shard spec does not match its variables (missing: {missing or 'none'}, "
            f"unknown: {extra or 'none'})"
        )
    for var in variables:
        spec = answer[var.name]
        if spec.tp_dim is not None and not 0 <= spec.tp_dim < len(var.shape):
            raise PluginError(f"{component}: shard spec of {var.name} splits dim {spec.tp_dim} of {var.shape}")
        spec.local_shape(var.shape, tensor_parallel)  # raises when it does not divide
    return {n: answer[n] for n in names}
