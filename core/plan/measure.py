"""What one micro-batch through one unit computes and holds, measured from the real shapes without
allocating: its FLOPs, the bytes autograd saves for its backward, and the bytes live at its busiest moment.

The unit's module runs with fake tensors (``torch._subclasses.FakeTensorMode``: tensors of the run's device
and dtype that hold no memory) bound in place of its weights (``functional_call``, on a copy of the module,
so that nothing it caches outlives the measurement), under ``FlopCounterMode`` for the FLOPs, a
saved-tensors hook for the saved bytes, and a dispatch mode that follows every tensor an op makes until it
is freed for the live bytes. Fake tensors report the run's device, so a component takes the path it takes
there (GPT-J's block computes 16-bit attention in float32 on the CPU) and attention runs the device's
kernel. This is what ``ipuft plan`` builds its compute and memory figures from, so that they follow whatever
a component plugin does (a recompute that skips work, a gradient autograd makes in the weight's layout), not
a formula of one model family. Where the rows pack several examples (:func:`packs_examples`), the unit runs
with positions (:func:`ipuft.attention.examples_apart`), so that the attention's mask and its masked kernel are
measured too.

A decoder may differ from layer to layer (it reads :func:`ipuft.attention.current_layer`): a sliding window on
some layers, full attention on others. One fake token through each layer with a key/value cache says how it
attends (:func:`kv_cache_layers`: the bytes it caches per position, and its window); a decoder unit is measured
once per kind (as its first layer of that window, under :func:`ipuft.attention.decoder_layer`), and its cost
is the costliest kind's, each figure the largest of the kinds' (a full layer's causal kernel against a
window's mask): what every layer is planned at.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields

import torch
from omegaconf import DictConfig
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from ipuft.attention import decoder_layer, examples_apart
from ipuft.components import recompute
from ipuft.engine.cuts import step_shape
from ipuft.engine.model import ModelParts
from ipuft.engine.store import storage_bytes
from ipuft.head_loss import head_chunks
from ipuft.hostmem import heap_block_limit
from ipuft.ops import SliceMoves, WeightGradients, taking_weight_gradients
from ipuft.precision import compute_dtype
from ipuft.preference import Pairs, PreferenceLoss, preference_pairs


def _register_cpu_attention_flops() -> None:
    """The CPU's flash-attention ops have no FLOP formula in ``FlopCounterMode``: theirs are the other SDPA
    kernels' (dense ``T × T`` scores, forward and backward)."""
    ops = torch.ops.aten
    if ops._scaled_dot_product_flash_attention_for_cpu not in flop_registry:
        @register_flop_formula(ops._scaled_dot_product_flash_attention_for_cpu)
        def _forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return sdpa_flop_count(query_shape, key_shape, value_shape)

    if ops._scaled_dot_product_flash_attention_for_cpu_backward not in flop_registry:
        @register_flop_formula(ops._scaled_dot_product_flash_attention_for_cpu_backward)
        def _backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_register_cpu_attention_flops()


def packs_examples(cfg: DictConfig) -> bool:
    """Whether the step's batches carry positions (:class:`~ipuft.data.batch.Batch`): a dataset's rows packed
    with their examples kept whole, as :func:`ipuft.data.tokens.layout_of` lays them out; the synthetic sample
    has none."""
    from ipuft.data.tokens import Layout, layout_of  # the data modules import no engine: no cycle

    return cfg.data.path is not None and layout_of(cfg)[0] is Layout.whole


def fake_positions(cfg: DictConfig, device: torch.device, mode: FakeTensorMode) -> torch.Tensor | None:
    """One micro-batch's fake positions where the rows pack examples (any values: only the shapes count)."""
    if not packs_examples(cfg):
        return None
    with mode:
        return torch.zeros(cfg.execution.micro_batch_size, cfg.model.sequence_length, dtype=torch.int64,
                           device=device)


def fake_unit(parts: ModelParts, role: str, cfg: DictConfig, device: torch.device, mode: FakeTensorMode):
    """One micro-batch's call of a unit of ``role`` with fake tensors on ``device``: ``(module, params, args)``,
    a copy of the unit's module, the trainable weights and the layer input requiring gradients, as the
    engine's backward has them."""
    mbs, seq, hidden = cfg.execution.micro_batch_size, cfg.model.sequence_length, cfg.model.hidden_size
    trainable = {v.name for v in parts.uses(role) if v.trainable}
    dtypes = {v.name: v.dtype for v in parts.uses(role)}  # the run's precision; the module's shapes (its TP)
    with mode:
        params = {v.name: torch.empty(v.shape, dtype=dtypes[v.name], device=device, requires_grad=v.name in trainable)
                  for v in parts.modules[role].variable_specs()}
        ids = torch.zeros(mbs, seq, dtype=torch.int64, device=device)
        x = torch.empty(mbs, seq, hidden, dtype=compute_dtype(cfg), device=device, requires_grad=True)
    args = {"embeddings": (ids,), "decoder": (x,), "head": (x, ids)}[role]
    return copy.deepcopy(parts.modules[role]), params, args


class LiveBytes(TorchDispatchMode):
    """Follows every tensor an op makes inside the block until it is freed, by its storage: the peak of the
    bytes alive at once (``peak``), and of those in blocks glibc's heap serves (``heap_peak``: under
    ``heap_limit``, the model's :func:`ipuft.hostmem.heap_block_limit`; the heap keeps them,
    ``execution.retain_host_memory``). The storages of ``existing`` tensors (weights, inputs), and views of them,
    are not counted."""

    def __init__(self, existing: list[torch.Tensor], heap_limit: int) -> None:
        super().__init__()
        self._heap_limit = heap_limit
        self._existing = {StorageWeakRef(t.untyped_storage()).cdata for t in existing}
        self._alive: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = self.heap_peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = StorageWeakRef(t.untyped_storage())
                if storage.cdata not in self._existing:
                    self._alive.setdefault(storage.cdata, (storage, t.untyped_storage().nbytes()))
        total, heap = self._alive_bytes()
        self.peak, self.heap_peak = max(self.peak, total), max(self.heap_peak, heap)
        return out

    def _alive_bytes(self) -> tuple[int, int]:
        total = heap = 0
        for key, (storage, size) in list(self._alive.items()):
            if storage.expired():
                del self._alive[key]
                continue
            total += size
            heap += size if size < self._heap_limit else 0
        return total, heap

    def restart(self) -> int:
        """Start a new ``peak`` from the bytes alive now; returns the peak until now."""
        before, self.peak = self.peak, self._alive_bytes()[0]
        return before


@dataclass(frozen=True)
class UnitCost:
    """One micro-batch through one unit.

    - ``forward``, ``backward``, ``recompute``: FLOPs of its forward, its backward, and the forward its
      backward recomputes (less than the forward when a component skips what only the output's value needs);
    - ``saved_bytes``: what autograd saves for the backward (a graph ``execution.recompute=false`` keeps);
    - ``forward_peak_bytes``: the most bytes alive at once in a forward without autograd (the output too);
    - ``backward_peak_bytes``: the same for a recompute and its backward, autograd's fresh gradients included;
      the weight gradients taken after the micro-batch (see :mod:`ipuft.ops`) are written into memory given
      to the take, as the engine gives it the unit's stored gradients where it can (else add ``taken_bytes``);
    - ``held_bytes``: what the projections hold for their taken weight gradients after its backward, until
      they are taken (beside the next micro-batches' when a take covers several);
    - ``taken_bytes``: the bytes of the gradients taken that way (the rest of the unit's trainable bytes are
      autograd's), and ``take_peak_bytes`` the most bytes alive while they are taken (into given memory);
    - ``heap_peak_bytes``: the most of those alive at once in blocks glibc's heap serves (and keeps);
    - ``accumulated_bytes``: the float32 sums some ops add their weight gradients into as they go, over every
      micro-batch (a chunked head's, :mod:`ipuft.head_loss`; counted in the peaks above), and
      ``accumulated_gradient_bytes`` the bytes of those weights' gradients in the weights' dtype (neither
      autograd's nor taken);
    - ``sliced_gradient_numel``: the elements of the weight gradients made by vocabulary slices into the stored
      gradients (``execution.head_vocab_slices``, :mod:`ipuft.engine.sliced`), never whole on the device; the
      inputs that work keeps in host memory, ``stash_bytes`` a micro-batch, each brought back
      ``stash_fetches`` times (once a slice).
    """

    forward: int
    backward: int
    recompute: int
    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    held_bytes: int
    heap_peak_bytes: int
    taken_bytes: int = 0
    take_peak_bytes: int = 0
    accumulated_bytes: int = 0
    accumulated_gradient_bytes: int = 0
    sliced_gradient_numel: int = 0
    stash_bytes: int = 0
    stash_fetches: int = 0


def _saved_bytes(module, params, args) -> int:
    """Bytes autograd saves for one forward with gradient, counted by storage, as the engine's ledger counts
    real tensors: a view (a transposed weight, a head's slice) costs nothing beyond its base, and the weights
    and the layer input are counted elsewhere."""
    excluded = {id(t) for t in (*params.values(), *args) if t.is_floating_point()}  # token ids are saved
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        root = t._base if t._base is not None else t
        if id(root) not in excluded:
            excluded.add(id(root))
            total += root.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        functional_call(module, params, args)
    return total


def unit_cost(parts: ModelParts, role: str, cfg: DictConfig, device: torch.device | str = "cpu",
              kv_layers: list[tuple[int, int | None]] | None = None) -> UnitCost:
    """Measure one micro-batch through a unit of ``role`` computing on ``device`` (see :class:`UnitCost`); a
    decoder's is its costliest layer kind's (see the module's docstring), from ``kv_layers``
    (:func:`kv_cache_layers`, probed here when not given)."""
    if role != "decoder":
        return _layer_cost(parts, role, cfg, torch.device(device), None)
    kinds: dict[int | None, int] = {}
    for layer, (_, window) in enumerate(kv_layers or kv_cache_layers(parts, cfg)):
        kinds.setdefault(window, layer)
    costs = [_layer_cost(parts, role, cfg, torch.device(device), layer) for layer in kinds.values()]
    return UnitCost(*(max(getattr(c, f.name) for c in costs) for f in fields(UnitCost)))


def _layer_cost(parts: ModelParts, role: str, cfg: DictConfig, device: torch.device, layer: int | None) -> UnitCost:
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # a module's cached real tensors (a rotary table) are read
    module, params, args = fake_unit(parts, role, cfg, device, mode)
    spec = PreferenceLoss.of(cfg) if role == "head" else None  # pairs: the head's loss is theirs (a pre-pass)
    pairs = Pairs(spec, torch.zeros(cfg.execution.micro_batch_size)) if spec is not None else None
    with examples_apart(fake_positions(cfg, device, mode)), decoder_layer(layer), preference_pairs(pairs):
        # A tied table whose gradient stays in host memory (ipuft.engine.sliced): its lookups add rows there.
        tables = {t.variable for t in parts.program.ties if t.owner.role == role and t.trainable} \
            if step_shape(cfg).host_tables else set()
        return _unit_cost(module, params, args, mode, cfg, tables)


def _unit_cost(module, params, args, mode: FakeTensorMode, cfg: DictConfig, tables: set[str]) -> UnitCost:
    existing = [*params.values(), *args]
    leaves = [t for t in existing if t.requires_grad]
    heap_limit = heap_block_limit(cfg.model.hidden_size)
    with mode:
        with (torch.no_grad(), LiveBytes(existing, heap_limit) as forward_live,
              FlopCounterMode(display=False) as counted):
            functional_call(module, params, args)
        forward = counted.get_total_flops()
        if not leaves:  # a frozen first unit: its backward does nothing
            return UnitCost(forward, 0, 0, 0, forward_live.peak, 0, 0, forward_live.heap_peak)
        slices = _MeasuredSlices({id(params[n]): torch.empty(params[n].shape, dtype=torch.float32, device="cpu")
                                  for n in tables if n in params})
        taken = WeightGradients(leaves, slices)
        homes = {id(leaf): torch.empty_like(leaf) for leaf in leaves}  # the stored gradients a take writes into
        chunks = head_chunks(cfg.execution.head_chunk_tokens, 1.0, cfg.execution.head_vocab_slices)
        with LiveBytes([*existing, *homes.values(), *slices.tables.values()], heap_limit) as live, chunks:
            with taking_weight_gradients(taken):
                with recompute(), FlopCounterMode(display=False) as counted:
                    out = functional_call(module, params, args)
                again = counted.get_total_flops()
                with FlopCounterMode(display=False) as counted:
                    torch.autograd.backward(out, torch.ones_like(out), inputs=leaves)
                    del out
                    held = storage_bytes(taken.held(), existing)
                    summed = {id(leaf): leaf for leaf, _ in taken.accumulated()}
                    accumulated = storage_bytes([total for _, total in taken.accumulated()], existing)
                    backward_peak = live.restart()
                    grads = list(taken.take(lambda leaf: homes.get(id(leaf))))
                    take_peak = live.peak
                    taken_bytes = sum(g.numel() * g.element_size() for leaf, g in grads if id(leaf) not in summed)
                    accumulated_gradient = sum(leaf.numel() * leaf.element_size() for leaf in summed.values())
            # A loss that makes its gradient in its forward (a chunked head, ipuft.head_loss) computes its backward
            # in the recompute: what that adds beyond the forward is backward work (a recompute that skips work
            # adds none).
            moved = max(0, again - forward)
            backward, again = counted.get_total_flops() + moved, again - moved
            del grads
        with head_chunks(cfg.execution.head_chunk_tokens, 1.0, cfg.execution.head_vocab_slices):
            saved = _saved_bytes(module, params, args)  # (a head's loss by chunks saves no logits)
    return UnitCost(forward, backward, again, saved, forward_live.peak, max(backward_peak, take_peak), held,
                    max(forward_live.heap_peak, live.heap_peak), taken_bytes, take_peak, accumulated,
                    accumulated_gradient, sum(leaf.numel() for leaf in taken.homed), slices.stashed,
                    slices.fetches)


class _MeasuredSlices(SliceMoves):
    """The engine's way with a gradient made by vocabulary slices (:class:`ipuft.engine.sliced.StoredSlices`),
    measured: the slices go to the stored gradient, outside the device (dropped here), and the stashed inputs
    are counted: their bytes per micro-batch, and how often each is brought back."""

    def __init__(self, tables: dict[int, torch.Tensor]) -> None:
        self.stashed = self.fetches = 0
        self.tables = tables  # a tied table's gradient in host memory, by its weight's id

    def rows_home(self, weight: torch.Tensor) -> torch.Tensor | None:
        return self.tables.get(id(weight))

    def stash(self, t: torch.Tensor) -> torch.Tensor:
        self.stashed += t.numel() * t.element_size()
        return t

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        self.fetches += 1
        return t

    def output(self, leaf: torch.Tensor) -> None:
        return None

    def put(self, leaf: torch.Tensor, out: torch.Tensor | None, start: int, grad: torch.Tensor) -> None:
        pass


def kv_cache_layers(parts: ModelParts, cfg: DictConfig) -> list[tuple[int, int | None]]:
    """Each decoder layer's key/value cache, as the decoder itself fills it: the bytes it holds per position of
    one row (``2 × hidden`` values for GPT-J, ``2 × kv_heads × head_dim`` for grouped-query attention), and the
    window it keeps (``None``: every position; with a window ``W`` it keeps the last ``W``). One fake token
    through each layer with a cache (TP=1, the run's precision), under that layer's
    :func:`ipuft.attention.decoder_layer`."""
    from ipuft.generate import LayerKVCache

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    dtypes = {v.name: v.dtype for v in parts.variables["decoder"]}
    module = copy.deepcopy(parts.modules["decoder"]).eval()
    layers = []
    with mode, torch.no_grad():
        params = {v.name: torch.empty(v.shape, dtype=dtypes[v.name]) for v in module.variable_specs()}
        x = torch.empty(1, 1, cfg.model.hidden_size, dtype=compute_dtype(cfg))
        for layer in range(cfg.model.layers):
            cache = LayerKVCache()
            with decoder_layer(layer):
                functional_call(module, params, (x, cache))
            layers.append((cache.nbytes, cache.window))
    return layers


def kv_cache_bytes_per_position(parts: ModelParts, cfg: DictConfig) -> int:
    """The most bytes one decoder layer's key/value cache holds per position of one row
    (:func:`kv_cache_layers`)."""
    return max(per_position for per_position, _ in kv_cache_layers(parts, cfg))
