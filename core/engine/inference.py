"""Forward-only passes through a stored model, layer-major: ``eval``, ``generate`` and MNLI scoring.

A batch of rows runs unit by unit, as a training step's forward does: each unit's weights come to the
device once for the whole batch (gathered over TP), and leave before the next unit's come. Between units
only the batch's hidden states survive, and each decoder layer's key/value cache lives where the
activations do: on the device, or in host memory with ``execution.activation_offload=true`` (brought to
the device only while its layer runs). So the device holds one unit plus the batch's buffers however deep
the model is, and with offloaded weights a decoding step pays one load per unit for every row of the
batch together, not one per row: the argument for batch serialisation, again.

The store's ledger counts what is on the device (``device_peak_bytes``) and its traffic counters the
host↔device copies, as in training.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ipuft.attention import decoder_layer, examples_apart
from ipuft.components import IGNORE_INDEX, bound
from ipuft.errors import ConfigError, DataError
from ipuft.generate import KVCache, LayerKVCache
from ipuft.head_loss import head_chunks
from ipuft.program import Op, Phase

if TYPE_CHECKING:
    from ipuft.data.tokens import TokenDataset
    from ipuft.engine.stored import StoredModel


@contextlib.contextmanager
def evaluating(modules) -> Iterator[None]:
    """Dropout off: every (sub)module's ``training`` flag is False inside, and restored afterwards (the
    modules are shared with a training engine, whose validation passes run between its steps)."""
    flags = [(m, m.training) for module in modules.values() for m in module.modules()]
    try:
        for m, _ in flags:
            m.training = False
        yield
    finally:
        for m, training in flags:
            m.training = training


def forward_phases(model: StoredModel) -> list[Phase]:
    """The program's phases that run a unit's forward (the head's is its loss phase), in order."""
    return [p for p in model.program if Op.FORWARD in p.ops or Op.LOSS_BACKWARD in p.ops]


class LayerMajor:
    """Runs batches forward through a stored model's units, one unit's weights on the device at a time."""

    def __init__(self, model: StoredModel) -> None:
        self.model = model
        self.store = model.store
        self.device = model.device
        self.layers = model.cfg.model.layers
        self.offload = bool(model.cfg.execution.activation_offload)
        phases = forward_phases(model)
        self.body = [p for p in phases if p.role != "head"]
        self.head_phase = next(p for p in phases if p.role == "head")

    @contextlib.contextmanager
    def _unit(self, phase: Phase) -> Iterator[torch.nn.Module]:
        """The unit's module with its weights on the device, bound, for the block."""
        stored = self.store.load(phase.unit, "fwd")
        borrowed = self.model.borrow(phase.role)  # tied variables, their owners'
        module = self.model.modules[phase.role]
        try:
            with self.model.gathered(phase.role, {**stored, **borrowed}) as weights, bound(module, weights):
                yield module
        finally:
            self.store.release(stored)
            self.store.release(borrowed)

    # ---- where the batch's buffers live ----

    def _park(self, hidden: torch.Tensor) -> torch.Tensor:
        """Keep ``hidden`` between units: moved to the host with activation offload, else counted on the device."""
        if not self.offload:
            self.store.hold(hidden.numel() * hidden.element_size())
            return hidden
        return self.store.send(hidden, "activation")

    def _fetch(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` back on the device for the next unit; its parked bytes are then the unit's input."""
        return self.store.bring(hidden, "activation", copy=False) if self.offload else hidden

    def _done_with(self, hidden: torch.Tensor) -> None:
        self.store.free(hidden.numel() * hidden.element_size())

    @contextlib.contextmanager
    def _layer_cache(self, cache: LayerKVCache | None) -> Iterator[LayerKVCache | None]:
        """The layer's cache on the device while its layer runs; back to the host after, with offload."""
        if cache is None:
            yield None
            return
        before = cache.nbytes
        if self.offload:
            cache.moved(lambda t: self.store.bring(t, "activation", copy=False))
        try:
            yield cache
        finally:
            grown = cache.nbytes - before
            self.store.hold(grown)  # the new positions' keys and values, made on the device
            if self.offload:  # pinned, and copied asynchronously, on CUDA
                held = cache.nbytes
                cache.moved(lambda t: self.store.send(t, "activation", copy=False))
                self.store.free(held)

    def release(self, cache: KVCache | None) -> None:
        """The caller is done with ``cache``: its device bytes (without offload) are free."""
        if cache is not None and not self.offload:
            self.store.free(cache.nbytes)

    # ---- passes ----

    def hidden(self, input_ids: torch.Tensor, cache: KVCache | None = None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states ``[B, T, H]`` of ``input_ids[B, T]`` on the device, before the head (the
        caller owns their device bytes until :meth:`head`). With a ``cache`` the ids continue its positions;
        with ``positions[B, T]`` (packed examples, :class:`~ipuft.data.batch.Batch`) each example is apart."""
        hidden = None
        packed = None if positions is None else positions.to(self.device)
        with torch.no_grad(), evaluating(self.model.modules), examples_apart(packed):
            for phase in self.body:
                with self._unit(phase) as module:
                    if phase.layer is None:
                        out = module(input_ids.to(self.device))
                    else:
                        x = self._fetch(hidden)
                        with self._layer_cache(None if cache is None else cache[phase.layer]) as layer, \
                                decoder_layer(phase.layer):
                            out = module(x) if layer is None else module(x, cache=layer)
                        self._done_with(x)
                hidden = self._park(out)
        return self._fetch(hidden)

    def head(self, hidden: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The head's logits of ``hidden[B, T, H]`` (on the device), or only of ``positions[B, K]`` of each row
        (``[B, K, V]``); frees ``hidden``'s device bytes."""
        if positions is not None:
            index = positions.to(hidden.device).unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
            picked = hidden.gather(1, index)
            self.store.hold(picked.numel() * picked.element_size())
            self._done_with(hidden)
            hidden = picked
        with torch.no_grad(), evaluating(self.model.modules), self._unit(self.head_phase) as module:
            logits = module(hidden)
            with self.store.holding(logits.numel() * logits.element_size()):  # its peak, with the head's weights
                pass
        self._done_with(hidden)
        return logits

    def loss_sum(self, input_ids: torch.Tensor, labels: torch.Tensor,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """The sum of the token losses (float64, on the device) and the number of tokens that count, over
        ``input_ids[B, T]`` (its examples' ``positions``, when packed) and its already shifted ``labels[B, T]``
        (``IGNORE_INDEX``: not counted). The head's loss goes by the run's chunks of tokens
        (``execution.head_chunk_tokens``), as in training: a micro-batch's logits over the whole vocabulary
        (Llama 3's 128256 columns, 2 GiB a 4096-token row in float32) never exist at once."""
        hidden = self.hidden(input_ids, positions=positions)
        labels = labels.to(self.device)
        with torch.no_grad(), evaluating(self.model.modules), head_chunks(self.model.cfg.execution.head_chunk_tokens), \
                self._unit(self.head_phase) as module:
            mean = module(hidden, labels)
        self._done_with(hidden)
        count = int((labels != IGNORE_INDEX).sum())
        return mean.double() * count, count

    def logits(self, input_ids: torch.Tensor, cache: KVCache | None = None, last_only: bool = False) -> torch.Tensor:
        """Logits ``[B, T, V]`` over the vocabulary of ``input_ids[B, T]`` (``[B, 1, V]``, the last position's,
        if ``last_only``)."""
        hidden = self.hidden(input_ids, cache)
        if not last_only:
            return self.vocabulary(self.head(hidden))
        last = torch.full((hidden.shape[0], 1), hidden.shape[1] - 1, dtype=torch.long)
        return self.vocabulary(self.head(hidden, last))

    def vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits``, checked to be over the vocabulary: what generating text and scoring labels by their
        likelihood need, and what a classification head's scores are not."""
        model = self.model.cfg.model
        if logits.shape[-1] != model.embedding.vocab_size:
            raise ConfigError(f"model.head: {model.head} gives {logits.shape[-1]} scores per position, not logits "
                              f"over the {model.embedding.vocab_size}-token vocabulary; generating text and scoring "
                              f"labels by their likelihood need a language-model head (ipuft eval's loss task works "
                              f"with any head)")
        return logits


def dataset_loss(model: StoredModel, dataset: TokenDataset, micro_batch_size: int) -> dict:
    """``{"loss", "perplexity", "tokens"}``: the mean token loss over every row of ``dataset``, once, in
    order, layer-major through the model's units, one micro-batch of rows per pass (each DP replica takes its
    own micro-batches)."""
    layout = model.layout
    runner = LayerMajor(model)
    total = torch.zeros(2, dtype=torch.float64, device=model.device)  # where the backend (NCCL) can reduce it
    for batch in dataset.eval_batches(micro_batch_size, layout.dp_rank, layout.data_parallel):
        for mb in range(batch.micro_batches):
            positions = None if batch.positions is None else batch.positions[mb]
            loss_sum, tokens = runner.loss_sum(batch.input_ids[mb], batch.labels[mb], positions)
            total[0] += loss_sum
            total[1] += tokens
    if layout.data_parallel > 1:
        dist.all_reduce(total, group=layout.dp_group)
    loss_sum, tokens = total.tolist()
    if tokens == 0:
        raise DataError(f"{dataset.name}: no token of the dataset counts in the loss")
    loss = loss_sum / tokens
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(tokens)}
