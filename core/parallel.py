"""Process layout and collectives for data, tensor and replicated-tensor-sharded parallelism.

The layout is the reference's: world = data_parallel × tensor_parallel; tensor-parallel groups are
consecutive ranks (stride 1, size TP) and data-parallel groups have stride TP. Processes are launched by
torchrun; ipuft uses torch.distributed (Gloo on CPU, NCCL on CUDA) and builds no transport of its own.

One process is one rank, so the active layout is process-wide (:func:`activate`). Component code calls the
collectives below, which are the identity when tensor parallelism is off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig

from ipuft.errors import ConfigError, DistributedError, first_line
from ipuft.head_loss import chunkable, chunked_head_loss, head_chunk_tokens
from ipuft.preference import active_pairs
from ipuft.profiling import section, timed

# torch 2.13 renamed the flat collectives; older releases only have the second names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Layout:
    """This process's place in the DP × TP grid, and its process groups (``None`` when size 1)."""

    data_parallel: int = 1
    tensor_parallel: int = 1
    rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None

    @property
    def world(self) -> int:
        return self.data_parallel * self.tensor_parallel

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tensor_parallel

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints progress and writes the run directory."""
        return self.rank == 0


_ACTIVE = Layout()


def active() -> Layout:
    """The layout of this process (a single-rank layout until :func:`activate`)."""
    return _ACTIVE


def activate(layout: Layout) -> Layout:
    global _ACTIVE  # noqa: PLW0603 (the one process-wide layout)
    _ACTIVE = layout
    return layout


def leave() -> None:
    """Leave the process group, when this process joined one, at the end of a command that completed on
    every rank. Left to the interpreter's exit, Gloo's connection threads are torn down by static
    destructors while a peer may still be closing its side, which now and then aborts a rank after its
    work is done ('terminate called without an active exception', exit code -6)."""
    if dist.is_initialized():
        with collective_errors(active()):
            dist.barrier()  # no rank closes its connections while a peer still works over them
        dist.destroy_process_group()
    activate(Layout())


@contextmanager
def collective_errors(layout: Layout):
    """Turn a failed collective (a dead or stuck peer) into one clear error naming this rank."""
    try:
        yield
    except (RuntimeError, dist.DistBackendError) as exc:
        if not layout.distributed:
            raise
        raise DistributedError(f"rank {layout.rank}: a peer rank died or stopped responding "
                               f"({first_line(exc, type(exc).__name__)}); "
                               f"stopping") from None


def launched_world() -> int:
    """How many processes torchrun started (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_layout(cfg: DictConfig, device: torch.device) -> Layout:
    """Join the process group torchrun set up and build the DP and TP groups; check the world size and
    that every rank resolved the same config.

    Every rank raises the same :class:`ConfigError` before any work starts when the world is not DP × TP,
    or when any rank's config differs from rank 0's. Collectives wait ``execution.collective_timeout_s``
    for a peer before failing.
    """
    dp, tp = cfg.execution.data_parallel, cfg.execution.tensor_parallel
    world = launched_world()
    if world != dp * tp:
        raise ConfigError(
            f"execution.data_parallel × execution.tensor_parallel = {dp} × {tp} = {dp * tp}, but {world} "
            f"process{'es were' if world != 1 else ' was'} launched; run torchrun --nproc-per-node={dp * tp} "
            f"--no-python ipuft train ... (or set the two keys to match the launch)"
        )
    if world == 1:
        return activate(Layout())
    # Every group's collectives (not only the default group's) wait this long for a peer.
    timeout = timedelta(seconds=cfg.execution.collective_timeout_s)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timeout)
    rank = dist.get_rank()
    tp_group = dp_group = None
    # Every rank must create every group, in the same order.
    for d in range(dp):
        group = dist.new_group([d * tp + t for t in range(tp)], timeout=timeout) if tp > 1 else None
        if rank // tp == d:
            tp_group = group
    for t in range(tp):
        group = dist.new_group([d * tp + t for d in range(dp)], timeout=timeout) if dp > 1 else None
        if rank % tp == t:
            dp_group = group
    check_ranks_agree(cfg, device)
    return activate(Layout(dp, tp, rank, tp_group, dp_group))


def check_ranks_agree(cfg: DictConfig, device: torch.device) -> None:
    """Raise the same :class:`ConfigError` on every rank when any rank resolved another config than rank 0
    (another override, preset or file): ranks that disagree would train on silently or hang."""
    import json

    from omegaconf import OmegaConf

    mine = json.dumps(OmegaConf.to_container(cfg, enum_to_str=True))
    every = [json.loads(text) for text in _gather_text(mine, device)]
    for rank, theirs in enumerate(every):
        difference = _first_difference(every[0], theirs)
        if difference is not None:
            # Every rank found the same difference; leave the group cleanly, so that no rank's exit aborts a
            # peer still tearing its connections down.
            dist.destroy_process_group()
            raise ConfigError(f"rank {rank} resolved another config than rank 0: {difference}; launch every rank "
                              f"with the same --config and overrides")


def _gather_text(text: str, device: torch.device) -> list[str]:
    """Every rank's ``text``, in rank order, as bytes over the default group (on ``device``, which its
    backend serves): nothing is pickled."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device))
    longest = max(int(n) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(parts, padded)
    return [bytes(p[: int(n)].cpu().tolist()).decode() for p, n in zip(parts, sizes)]


def _first_difference(a, b, key: str = "") -> str | None:
    """The first key whose value differs between two config containers, as ``key: a vs b``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            found = _first_difference(a.get(k), b.get(k), f"{key}.{k}" if key else str(k))
            if found is not None:
                return found
        return None
    return None if a == b else f"{key or 'config'} is {b!r} there, {a!r} on rank 0"


# ---- tensor-parallel collectives, as paired autograd functions ----------------------------------------


class _CopyToTensorParallel(torch.autograd.Function):
    """Forward: identity; backward: all-reduce over the TP group.

    Marks where a replicated activation enters sharded computation: each rank's gradient is partial.
    """

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    @timed("collectives")
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=_ACTIVE.tp_group)
        return grad


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Forward: all-reduce (sum) over the TP group; backward: identity.

    Sums the partial results of sharded computation into a replicated activation.
    """

    @staticmethod
    @timed("collectives")
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x, group=_ACTIVE.tp_group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _GatherFromTensorParallel(torch.autograd.Function):
    """Forward: all-gather along the last dimension over the TP group; backward: keep this rank's slice."""

    @staticmethod
    @timed("collectives")
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(_ACTIVE.tensor_parallel)]
        dist.all_gather(parts, x.contiguous(), group=_ACTIVE.tp_group)
        ctx.size = x.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(-1, _ACTIVE.tp_rank * ctx.size, ctx.size).contiguous()


def copy_to_tensor_parallel(x: torch.Tensor) -> torch.Tensor:
    """Identity forward, all-reduced gradient; the identity when TP is off."""
    return _CopyToTensorParallel.apply(x) if _ACTIVE.tensor_parallel > 1 else x


def reduce_from_tensor_parallel(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group, gradient passed through; the identity when TP is off."""
    return _ReduceFromTensorParallel.apply(x) if _ACTIVE.tensor_parallel > 1 else x


def gather_from_tensor_parallel(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the TP ranks' last dimensions, gradient sliced back; the identity when TP is off."""
    return _GatherFromTensorParallel.apply(x) if _ACTIVE.tensor_parallel > 1 else x


def max_over_tensor_parallel(x: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum over the TP group (no gradient: used for numerical stability only)."""
    if _ACTIVE.tensor_parallel == 1:
        return x.detach()
    x = x.detach().clone()
    with section("collectives"):
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_ACTIVE.tp_group)
    return x


def tensor_parallel_rank() -> int:
    return _ACTIVE.tp_rank


def vocab_block(ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` relative to this TP rank's block of ``rows`` vocabulary rows, and which of them fall in it."""
    local = ids - tensor_parallel_rank() * rows
    return local, (local >= 0) & (local < rows)


def vocab_parallel_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """This TP rank's block ``logits[..., rows]`` of a vocabulary padded to a multiple of TP ranks, with its
    padded columns (ids ≥ ``vocab_size``) pushed to the dtype's minimum so that they never win."""
    rows = logits.shape[-1]
    first = tensor_parallel_rank() * rows
    if first + rows <= vocab_size:
        return logits
    padded = torch.arange(first, first + rows, device=logits.device) >= vocab_size
    return logits.masked_fill(padded, torch.finfo(logits.dtype).min)


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                                 mean: bool = True) -> torch.Tensor:
    """The mean cross-entropy over the tokens whose label is not ``ignore_index`` (``mean=False``: each token's,
    0 where not trained), from each TP rank's
    vocabulary block of the logits (``logits[N, rows]``, float32; ``labels[N]``): the maximum, the sum of
    exponentials and the target logit are reduced over the TP group, so the full logits are never gathered.
    At TP=1 it is ``F.cross_entropy``'s value. Gradients flow through the paired collectives."""
    rows = logits.shape[-1]
    shift = max_over_tensor_parallel(logits.max(dim=-1, keepdim=True).values)
    shifted = logits - shift
    sum_exp = reduce_from_tensor_parallel(shifted.exp().sum(dim=-1))
    local, mine = vocab_block(labels, rows)
    target = shifted.gather(-1, local.clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1) * mine
    target = reduce_from_tensor_parallel(target)
    keep = labels != ignore_index
    losses = (sum_exp.log() - target) * keep
    if not mean:
        return losses
    return losses.sum() / keep.sum().clamp_min(1)  # no trained token: 0, with a zero gradient


def vocab_parallel_embedding(table: torch.nn.Embedding, ids: torch.Tensor, tensor_parallel: int) -> torch.Tensor:
    """``table(ids)`` where each of the ``tensor_parallel`` ranks' ``table`` holds a contiguous block of the
    (padded) vocabulary: ids outside this rank's block look up zeros, and the partial lookups are summed over
    the TP group. At TP=1, ``table(ids)``."""
    if tensor_parallel == 1:
        return table(ids)
    local, inside = vocab_block(ids, table.weight.shape[0])
    outside = ~inside
    return reduce_from_tensor_parallel(table(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0))


def softcapped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap · tanh(logits / cap)`` in the logits' dtype, the three ops transformers' Gemma 2 applies for its
    ``final_logit_softcapping`` (so that autograd rounds their gradient as it does there); ``None``: the logits."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def vocab_parallel_head(project: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                        labels: torch.Tensor | None, vocab_size: int, tensor_parallel: int,
                        ignore_index: int = -100, softcap: float | None = None) -> torch.Tensor:
    """A language-model head's result from ``project`` (this TP rank's vocabulary block of the projection, of
    ``tensor_parallel``) of the normalised ``hidden``: the logits ``[..., vocab_size]`` (gathered over TP,
    padded columns cut), or with ``labels`` the mean cross-entropy in float32 (:func:`vocab_parallel_cross_entropy`
    under TP, so the full logits are never gathered for it; ``F.cross_entropy`` at TP=1), 0 where no label is
    trained. ``softcap``: the logits are first soft-capped, :func:`softcapped` (Gemma 2's final-logit cap), each
    rank's block before its padded columns are pushed down.

    Inside :func:`ipuft.head_loss.head_chunks` (the engine's, ``execution.head_chunk_tokens``), a loss whose
    ``project`` is a plain linear projection is computed a chunk of tokens at a time with its gradient
    (:func:`ipuft.head_loss.chunked_head_loss`): the same loss and gradients without the logits of every token
    at once. Inside :func:`ipuft.preference.preference_pairs` the loss is the pairs' (:mod:`ipuft.preference`),
    of each token's cross-entropy."""
    if labels is not None and head_chunk_tokens() and chunkable(project):
        x = copy_to_tensor_parallel(hidden) if tensor_parallel > 1 else hidden
        return chunked_head_loss(x.flatten(0, -2), project.weight, project.bias, labels.flatten(), vocab_size,
                                 ignore_index, _ACTIVE.tp_rank, _ACTIVE.tp_group, _ACTIVE.tensor_parallel, softcap)
    pairs = active_pairs() if labels is not None else None
    if tensor_parallel == 1:
        logits = softcapped(project(hidden), softcap)
        if labels is None:
            return logits
        if pairs is not None:  # preference data: the pairs' loss of each token's cross-entropy
            labels = labels.flatten()
            return pairs.loss(F.cross_entropy(logits.flatten(0, -2).float(), labels, ignore_index=ignore_index,
                                              reduction="none"), labels)
        # F.cross_entropy's mean is its sum over the count (the same two roundings); over no trained token
        # (a micro-batch of prompts alone) 0 with a zero gradient, where the mean would be 0 / 0.
        labels = labels.flatten()
        total = F.cross_entropy(logits.flatten(0, -2).float(), labels, ignore_index=ignore_index, reduction="sum")
        return total / (labels != ignore_index).sum().clamp_min(1)
    logits = vocab_parallel_logits(softcapped(project(copy_to_tensor_parallel(hidden)), softcap), vocab_size)
    if labels is None:
        return gather_from_tensor_parallel(logits)[..., :vocab_size]
    if pairs is not None:
        labels = labels.flatten()
        return pairs.loss(vocab_parallel_cross_entropy(logits.flatten(0, -2).float(), labels, ignore_index, False),
                          labels)
    return vocab_parallel_cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index)
