"""The component contract: what an embeddings, decoder or head plugin provides to the engine.

A component is a plain ``torch.nn.Module`` that knows nothing of distribution or of where its
variables live. It *describes* its variables (:class:`VariableSpec`) so that the engine can own them:
the engine allocates them in the variable store and runs the module with one unit's tensors bound in
place of its parameters (:func:`bound`, the semantics of ``torch.func.functional_call``). One module
instance of the decoder serves every layer, as one compiled graph served every layer in the reference.

Module call conventions, by role:

- ``embeddings``: ``forward(input_ids: Long[B, T]) -> Float[B, T, H]``
- ``decoder``: ``forward(hidden: Float[B, T, H], cache=None) -> Float[B, T, H]`` (one layer); for
  generation, ``cache`` is an :class:`ipuft.generate.LayerKVCache` the layer reads and appends its keys
  and values to (``None`` in training)
- ``head``: ``forward(hidden) -> logits``, and ``forward(hidden, labels) -> loss``: the mean cross-entropy
  over the micro-batch's tokens whose label is not ``IGNORE_INDEX`` (labels are already shifted: the
  label at position t is the token at t + 1)

Every component also implements ``variable_specs()`` and ``hf_mapping(layer)`` (:class:`Component`). What
else it may provide is a protocol of its own, which the engine and the exports test with ``isinstance``:
``hf_fused(layer)``, the Hugging Face tensors that hold several of its variables stacked (:class:`FusedRows`,
:class:`HasFusedTensors`); ``hf_config()`` (:class:`HasHFConfig`); ``hf_exportable`` (:class:`Exportability`);
``uses_dropout`` (:class:`DrawsMasks`); an adapter's methods (:class:`Adapted`, :class:`Merges`,
:class:`PeftExportable`). A
decoder may also declare ``projections`` (:class:`HasProjections`): ``{name: module path}`` for the
projections every family shares (``q``, ``k``, ``v``, ``o``, ``gate``, ``up``, ``down``; each an
:class:`ipuft.ops.Linear`), which adapters target by name (LoRA's ``plugins.lora.targets``), so that an adapter
plugin knows no decoder's module paths.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ipuft.errors import PluginError, choices
from ipuft.registry import Registry

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

    from ipuft.sharding import ShardSpec

ROLES = ("embeddings", "decoder", "head")
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Init:
    """How a variable is initialised: ``normal`` (mean 0, ``std``), ``uniform`` (mean 0 and ``std``: on
    ``[-√3·std, √3·std]``, as a Kaiming-uniform init is), ``zeros`` or ``ones``."""

    kind: str = "normal"
    std: float = 0.02

    def __post_init__(self) -> None:
        if self.kind not in ("normal", "uniform", "zeros", "ones"):
            raise ValueError(f"unknown init kind {self.kind!r}")

    def fill_(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Initialise ``tensor`` in place, drawing from ``generator`` when random."""
        import torch

        with torch.no_grad():
            if self.kind == "zeros":
                return tensor.zero_()
            if self.kind == "ones":
                return tensor.fill_(1.0)
            if self.kind == "uniform":
                bound = math.sqrt(3.0) * self.std
                return tensor.uniform_(-bound, bound, generator=generator)
            return tensor.normal_(0.0, self.std, generator=generator)


@dataclass(frozen=True)
class VariableSpec:
    """One variable of a component: its local name, shape, dtype (float32 when not given) and initialisation.

    ``trainable=False`` freezes it: no gradient is computed for it, it has no gradient store and no optimizer
    state, nothing of it moves for gradients or updates, and it takes no part in the global norm.
    ``added=True`` marks a variable that fine-tuning adds to a pretrained model (an adapter): it has no
    Hugging Face name, so importing a Hugging Face checkpoint starts it from its ``init``.
    ``tied_to="<unit>.<variable>"`` makes it another unit's variable (tied embeddings: the head's projection is
    ``embeddings.<table>.weight``): the component computes with it, but it is stored, trained, checkpointed and
    exported once, as the owner's (see :class:`ipuft.program.Tie`).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    init: Init = field(default_factory=Init)
    trainable: bool = True
    added: bool = False
    tied_to: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is None:  # torch is imported only once a spec is made, not when plugins are discovered
            import torch

            object.__setattr__(self, "dtype", torch.float32)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class FusedRows:
    """One Hugging Face tensor that holds several variables of a unit stacked by rows (dimension 0): Phi-3's
    ``self_attn.qkv_proj.weight`` is ``[q; k; v]``, its ``mlp.gate_up_proj.weight`` is ``[gate; up]``.

    ``parts`` are the variables' Hugging Face names as the component's ``hf_mapping`` gives them (the names an
    unfused family uses, ``self_attn.q_proj.weight``, which the fused checkpoint does not hold), in row order;
    each part's rows are its variable's first dimension. With ``groups`` > 1 the rows are ``groups`` equal
    blocks, each holding every part's next ``rows / groups`` rows in order (GPT-NeoX's ``query_key_value``: per
    head, its q, k and v rows).

    Only the files see the fused tensor: an import splits it into the parts (a tensor of another shape is one
    line), an export stacks them again, bit for bit. The engine, the plan, the store, LoRA, TP sharding and the
    optimizer see the parts as plain variables under their own names, and ``hf_mapping`` stays one name each,
    so that nothing that reads names needs to know.
    """

    name: str
    parts: tuple[str, ...]
    groups: int = 1

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or len(set(self.parts)) != len(self.parts) or self.groups < 1:
            raise ValueError(f"FusedRows {self.name}: two or more distinct parts and groups >= 1, got "
                             f"{self.parts}, groups={self.groups}")


@runtime_checkable
class Component(Protocol):
    """What the engine needs from a component module besides ``forward``."""

    def variable_specs(self) -> list[VariableSpec]:
        """Every variable the module's forward uses, named as in ``named_parameters()``."""
        ...

    def hf_mapping(self, layer: int | None) -> dict[str, str]:
        """Map each local variable name to its Hugging Face GPT-J parameter name (``layer`` for decoders)."""
        ...



# What a component may also provide, each a protocol of its own: the engine and the exports ask
# ``isinstance(module, <protocol>)`` and call what it declares; a component without it gets the stated default.

@runtime_checkable
class HasProjections(Protocol):
    """A decoder's shared projections, which adapters target by name (default: none, and no adapter)."""

    @property
    def projections(self) -> dict[str, str]:
        """Each shared projection name (q k v o gate up down) and its module's path (see the module docstring)."""
        ...


@runtime_checkable
class HasFusedTensors(Protocol):
    """A component whose Hugging Face checkpoint stacks several of its variables in one tensor (default: none)."""

    def hf_fused(self, layer: int | None) -> tuple[FusedRows, ...]:
        """The Hugging Face tensors that hold several of the unit's variables stacked (:class:`FusedRows`)."""
        ...


@runtime_checkable
class HasHFConfig(Protocol):
    """A component that contributes keys to an export's config.json (default: none)."""

    def hf_config(self) -> dict:
        """This component's part of a Hugging Face config.json."""
        ...


@runtime_checkable
class Exportability(Protocol):
    """A component that says whether a Hugging Face export can hold it (default: it can)."""

    hf_exportable: bool


@runtime_checkable
class DrawsMasks(Protocol):
    """A component that draws dropout masks of its own beyond ``model.dropout_prob`` (default: it draws none),
    which the engine seeds alike in a layer's forward and its recompute."""

    @property
    def uses_dropout(self) -> bool:
        ...


@runtime_checkable
class Adapted(Protocol):
    """A component with adapters added (LoRA: its ``added`` variables), split over TP its own way."""

    def adapter_shard_specs(self, base: dict[str, ShardSpec]) -> dict[str, ShardSpec]:
        """The adapters' TP layout, given the base variables' resolved one."""
        ...


@runtime_checkable
class Merges(Protocol):
    """A component whose ``added`` variables a Hugging Face export folds into the others (a LoRA merge)."""

    def hf_merge(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The unit's variables for a plain model, the adapters folded into the weights they adapt."""
        ...


@runtime_checkable
class PeftExportable(Protocol):
    """An adapted component whose adapters a peft adapter directory can hold (``ipuft export --adapter``)."""

    def peft_mapping(self, layer: int | None) -> dict[str, str]:
        """Each adapter variable's name in a peft adapter_model.safetensors (but those written stacked)."""
        ...

    def peft_stacked(self, layer: int | None) -> dict[str, list[str]]:
        """The peft tensors made of several adapter variables (a fused module's), with the variables of each."""
        ...

    def peft_stack(self, layer: int | None, name: str, tensors: dict[str, torch.Tensor],
                   shapes: dict[str, tuple[int, ...]]) -> torch.Tensor:
        """peft tensor ``name`` of :meth:`peft_stacked` from its variables ``tensors``."""
        ...

    def peft_config(self) -> dict:
        """The adapter's part of a peft adapter_config.json."""
        ...


def exportable(module: object) -> bool:
    """Whether a Hugging Face export can hold ``module`` (:class:`Exportability`)."""
    return not isinstance(module, Exportability) or bool(module.hf_exportable)


def has_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds values a component may read (to check its data, say): false while ipuft runs the
    component without them, on the meta device or on fake tensors, to measure its FLOPs and memory (``ipuft
    plan``, ``bench``; :mod:`ipuft.plan.measure`)."""
    from torch._subclasses.fake_tensor import is_fake

    return tensor.device.type != "meta" and not is_fake(tensor)


_RECOMPUTING = contextvars.ContextVar("ipuft_recomputing", default=False)


def recomputing() -> bool:
    """True while the engine re-runs a component's forward only to backpropagate through it.

    The *value* of the output is then discarded: only its autograd graph is used, with the incoming
    gradient. A component may skip work that only the output's value needs (the GPT-J decoder skips its
    output projections' matmuls); one that ignores this flag is still correct.
    """
    return _RECOMPUTING.get()


@contextmanager
def recompute() -> Iterator[None]:
    """Mark the block as a recompute for :func:`recomputing` (used by the engine)."""
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


@contextmanager
def bound(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[torch.nn.Module]:
    """``module`` computing with ``tensors`` in place of its parameters (named as in ``named_parameters()``)
    until the block ends, as ``torch.func.functional_call`` would for each call.

    A phase binds its unit once for all of its micro-batches; rebinding per call costs more Python time
    than a small layer's arithmetic. Every name must be one of the module's parameters.
    """
    slots = _parameter_slots(module)
    swapped = []
    try:
        for name, tensor in tensors.items():
            if name not in slots:
                raise KeyError(f"{type(module).__name__} has no parameter {name!r}")
            owner, leaf = slots[name]
            swapped.append((owner, leaf, owner._parameters[leaf]))
            owner._parameters[leaf] = tensor
        yield module
    finally:
        for owner, leaf, original in reversed(swapped):
            owner._parameters[leaf] = original


def _parameter_slots(module: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    """Each parameter's owning submodule and local name, computed once per module."""
    slots = module.__dict__.get("_ipuft_parameter_slots")
    if slots is None:
        slots = {}
        for name, _ in module.named_parameters():
            owner, _, leaf = name.rpartition(".")
            slots[name] = (module.get_submodule(owner), leaf)
        module.__dict__["_ipuft_parameter_slots"] = slots
    return slots


def specs_from_module(module: torch.nn.Module, inits: dict[str, Init]) -> list[VariableSpec]:
    """Describe a module's parameters as variable specs, taking each init from ``inits`` by name."""
    return [
        VariableSpec(name, tuple(p.shape), p.dtype, inits[name]) for name, p in module.named_parameters()
    ]


def tie(specs: list[VariableSpec], name: str, owner: str) -> list[VariableSpec]:
    """``specs`` with variable ``name`` tied to ``owner`` (``<unit>.<variable>``, see ``VariableSpec.tied_to``)."""
    return [replace(s, tied_to=owner) if s.name == name else s for s in specs]


ComponentFactory = Callable[["DictConfig"], "torch.nn.Module"]
# A component's TP layout, given with its registration: one ShardSpec per variable name. It is data, the same
# for every run; a layout computed from the variables or the run's config is a plugin's answer to the
# ipuft_shard_spec hook instead (the one other way).
ShardSpecs = Mapping[str, "ShardSpec"]


@dataclass(frozen=True)
class ComponentBuilder:
    """A named way to build the component of one role from the resolved config, with its TP layout."""

    role: str
    name: str
    build: ComponentFactory
    description: str = ""
    plugin: str = ""
    shard_specs: ShardSpecs | None = None

    def shard_specs_for(self, variables: list[VariableSpec], tensor_parallel: int,
                        cfg: DictConfig) -> Mapping[str, ShardSpec] | None:
        """The registered TP layout of this component's variables, or ``None`` if none was registered (the
        engine then asks ``ipuft_shard_spec``). A registered layout is data: it is the same whatever the
        variables, ``tensor_parallel`` and ``cfg`` (the hook's arguments, which the engine passes alike)."""
        return self.shard_specs


class ComponentRegistry(Registry):
    """Every component builder the installed plugins registered, keyed by role and name (see
    :mod:`ipuft.registry` for attribution and the duplicate rule)."""

    kind = "component"

    def __init__(self) -> None:
        super().__init__()
        self._builders: dict[tuple[str, str], ComponentBuilder] = {}

    def add(self, role: str, name: str, build: ComponentFactory, description: str = "",
            shard_specs: ShardSpecs | None = None) -> None:
        """Register ``build`` as component ``name`` for ``role`` (one of :data:`ROLES`).

        ``shard_specs``: how its variables split over tensor-parallel ranks, ``{name: ShardSpec}``. Without
        it, a plugin (its own, or another) may answer ``ipuft_shard_spec`` for it, with a layout computed from
        the variables or the run's config; else every variable is replicated (``tensor_parallel`` must be 1).
        """
        origin = self.origin()
        if role not in ROLES:
            raise PluginError(
                f"plugin {origin.plugin!r} registers component {name!r} for unknown role {role!r}; "
                f"roles: {', '.join(ROLES)}"
            )
        if shard_specs is not None and not isinstance(shard_specs, Mapping):
            raise PluginError(
                f"plugin {origin.plugin!r} registers {role} component {name!r} with shard_specs of type "
                f"{type(shard_specs).__name__}: give a mapping of variable name to ShardSpec, or answer the "
                f"ipuft_shard_spec hook for a layout computed from the variables or the config"
            )
        if self._claim((role, name), f"{role} component {name!r}", origin):
            self._builders[(role, name)] = ComponentBuilder(role, name, build, description, origin.plugin,
                                                            shard_specs)

    def get(self, role: str, name: str) -> ComponentBuilder:
        """The builder for ``role`` named ``name``; a :class:`PluginError` naming the choices if none."""
        try:
            return self._builders[(role, name)]
        except KeyError:
            raise PluginError(
                f"model.{role}: unknown {role} component {name!r}; available: {choices(self.names(role))}"
            ) from None

    def names(self, role: str) -> list[str]:
        return sorted(n for r, n in self._builders if r == role)

    def __iter__(self) -> Iterator[ComponentBuilder]:
        return iter(self._builders.values())
