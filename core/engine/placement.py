"""Where each variable lives under a DP × TP layout, and the moves between its forms.

A variable has three forms:

- *full*: the whole variable, as a single process holds it (``VariableSpec.shape``);
- *local*: this TP rank's shard (``ShardSpec.local_shape``), which the component computes with;
- *stored*: what this rank keeps in the variable store. Without RTS it is the local form. With RTS
  (replicated tensor sharding) it is this DP rank's 1/DP slice of the flattened local form, padded with
  zeros to a multiple of DP (of DP × the optimizer's block size, when its state is block-wise: every slice
  is then whole blocks); weights, optimizer state and gradients are all stored that way.

A phase all-gathers stored weights into the local form to compute, reduce-scatters local gradients into
the stored form (or all-reduces them without RTS), and the optimizer updates the stored form only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ipuft.components import VariableSpec
from ipuft.parallel import Layout, all_gather_flat, reduce_scatter_flat
from ipuft.profiling import section
from ipuft.sharding import ShardSpec


@dataclass(frozen=True)
class Placement:
    """One variable's forms under ``layout``; an RTS slice holds a multiple of ``multiple`` elements."""

    spec: VariableSpec
    shard: ShardSpec
    layout: Layout
    rts: bool
    multiple: int = 1

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.shard.local_shape(self.spec.shape, self.layout.tensor_parallel)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def sharded_over_dp(self) -> bool:
        return self.rts and self.shard.rts and self.layout.data_parallel > 1

    @property
    def stored_shape(self) -> tuple[int, ...]:
        if not self.sharded_over_dp:
            return self.local_shape
        multiple = self.layout.data_parallel * self.multiple
        return (math.ceil(self.local_numel / multiple) * self.multiple,)

    def blocks(self, block: int) -> Placement:
        """The placement of a state that holds one value per ``block`` consecutive elements of this variable's
        flat form (an optimizer's block state, :mod:`ipuft.optim`): a 1-D variable of one element per block,
        sliced by RTS as this variable is, block for block. Only at ``tensor_parallel`` 1 (a TP shard's
        blocks are not the full variable's: ``ipuft.engine.model.check_model`` refuses such state under TP)."""
        if self.sharded_over_dp and self.multiple % block:
            raise ValueError(f"{self.spec.name}: RTS slices of a multiple of {self.multiple} elements are not "
                             f"whole blocks of {block}")
        spec = replace(self.spec, shape=(math.ceil(self.spec.numel / block),))
        return Placement(spec, ShardSpec(rts=self.shard.rts), self.layout, self.rts)

    def stored_spec(self, name: str | None = None, dtype: torch.dtype | None = None) -> VariableSpec:
        return replace(self.spec, name=name or self.spec.name, shape=self.stored_shape, dtype=dtype or self.spec.dtype)

    # ---- forms ----

    def to_stored(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's stored form of the full variable."""
        local = self.shard.shard(full, self.layout.tp_rank, self.layout.tensor_parallel)
        if not self.sharded_over_dp:
            return local.contiguous()
        flat = self._padded_flat(local)
        return flat.chunk(self.layout.data_parallel)[self.layout.dp_rank].clone()

    def _padded_flat(self, local: torch.Tensor) -> torch.Tensor:
        flat = local.reshape(-1)
        pad = self.stored_shape[0] * self.layout.data_parallel - flat.numel()
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def gather(self, stored: torch.Tensor) -> torch.Tensor:
        """The local form, all-gathered over the DP group from every rank's stored form."""
        if not self.sharded_over_dp:
            return stored
        flat = stored.new_empty(stored.numel() * self.layout.data_parallel)
        with section("collectives"):
            all_gather_flat(flat, stored.contiguous(), group=self.layout.dp_group)
        return flat[: self.local_numel].view(self.local_shape)

    def reduce_gradient(self, local_grad: torch.Tensor) -> torch.Tensor:
        """Mean over the DP group, returned in the stored form (reduce-scatter with RTS)."""
        dp = self.layout.data_parallel
        if dp == 1:
            return local_grad
        if not self.sharded_over_dp:
            with section("collectives"):
                dist.all_reduce(local_grad, group=self.layout.dp_group)
            return local_grad.div_(dp)
        out = local_grad.new_empty(self.stored_shape)
        flat = self._padded_flat(local_grad)
        with section("collectives"):
            reduce_scatter_flat(out, flat, group=self.layout.dp_group)
        return out.div_(dp)

    def full_indices(self, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The flat index in the full variable of each stored element ``start … start+count-1`` (int64).

        Layout-free: one process, each TP shard and each RTS slice name every element alike. Padding
        (a padded vocabulary row, the zeros that round an RTS slice up) maps to indices past the end.
        """
        local = torch.arange(start, start + count, dtype=torch.int64, device=device)
        if self.sharded_over_dp:
            local += self.layout.dp_rank * self.stored_shape[0]
        full_shape = self.spec.shape
        if self.shard.replicated_over_tp or self.layout.tensor_parallel == 1:
            return local
        dim = self.shard.tp_dim
        inner = math.prod(self.local_shape[dim + 1 :])
        rows = self.local_shape[dim]
        outer, within = local.div(rows * inner, rounding_mode="floor"), local.remainder(rows * inner)
        row = within.div(inner, rounding_mode="floor") + self.layout.tp_rank * rows
        index = (outer * full_shape[dim] + row) * inner + within.remainder(inner)
        padding = (row >= full_shape[dim]) | (local >= self.local_numel)
        return torch.where(padding, math.prod(full_shape) + local, index)

    def counters(self, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor | int:
        """:meth:`full_indices`, or, where they are consecutive (one process, a replicated or row-sharded
        variable, an RTS slice of one), just the first of them: what stochastic rounding keys each element's
        bits on, without making the indices."""
        local = start + (self.layout.dp_rank * self.stored_shape[0] if self.sharded_over_dp else 0)
        if self.shard.replicated_over_tp or self.layout.tensor_parallel == 1:
            return local
        if self.shard.tp_dim == 0:  # this rank's rows are one block of the full variable, unless padding
            inner = math.prod(self.local_shape[1:])
            rows, last = self.local_shape[0], (local + count - 1) // inner
            if local + count <= self.local_numel and self.layout.tp_rank * rows + last < self.spec.shape[0]:
                return local + self.layout.tp_rank * rows * inner
        return self.full_indices(start, count, device)

    def norm_weight(self) -> float:
        """1 where this rank's stored gradient holds elements no other rank counts, else 0.

        Every element of the reduced gradient is counted exactly once over the whole world: TP-replicated
        variables only on TP rank 0, DP-replicated (non-RTS) variables only on DP rank 0.
        """
        if self.shard.replicated_over_tp and self.layout.tp_rank != 0:
            return 0.0
        if not self.sharded_over_dp and self.layout.dp_rank != 0:
            return 0.0
        return 1.0

    @property
    def collective(self) -> bool:
        """Whether :meth:`full` gathers from other ranks (else the stored form is the full variable)."""
        return self.sharded_over_dp or not (self.layout.tensor_parallel == 1 or self.shard.replicated_over_tp)

    def full(self, stored: torch.Tensor) -> torch.Tensor:
        """The full variable, gathered over DP and TP (every rank of the world must call this)."""
        local = self.gather(stored)
        tp = self.layout.tensor_parallel
        if tp == 1 or self.shard.replicated_over_tp:
            return local.clone()
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=self.layout.tp_group)
        return self.shard.unshard(parts, full_size=self.spec.shape[self.shard.tp_dim])
