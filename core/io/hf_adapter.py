"""``ipuft export --adapter``: the adapters of a checkpoint (``model.adapter``, LoRA) in peft's format, which
``peft.PeftModel.from_pretrained(base, OUT)`` loads onto the base model: ``adapter_config.json`` and
``adapter_model.safetensors``.

Generic machinery: the names and the config come from the adapted components (their ``peft_mapping(layer)``,
each adapter variable's name in the file, and ``peft_config()``, the adapter's part of adapter_config.json),
and the file holds those variables only, or tensors made of several of them where the component says so
(``peft_stacked(layer)`` and ``peft_stack``: peft adapts a fused module, Phi-3's ``qkv_proj``, as one). It
streams as ``--hf`` does (one tensor in memory, read from the checkpoint's model.safetensors and verified;
a stacked tensor's small adapter variables together), and is written into a temporary directory renamed into
place.
"""

from __future__ import annotations

import json
from pathlib import Path

from ipuft.components import PeftExportable, VariableSpec
from ipuft.errors import CheckpointError, PluginError
from ipuft.io.checkpoint import WEIGHTS, open_tensors
from ipuft.io.export_dir import staged_directory
from ipuft.precision import DTYPES
from ipuft.program import StepProgram

CONFIG, TENSORS = "adapter_config.json", "adapter_model.safetensors"


def is_adapter_export(out: Path) -> bool:
    """Whether directory ``out`` holds an earlier adapter export and nothing else (which a new one replaces)."""
    return {p.name for p in out.iterdir()} <= {CONFIG, TENSORS}


def adapter_names(parts, layers: int) -> tuple[dict[str, str], dict]:
    """``{"<unit>.<variable>": peft name}`` of every adapter variable, and the adapter's config: from each
    unit's component's ``peft_mapping`` and ``peft_config``; a :class:`PluginError` for a name given twice or
    for variables a mapping names that are not the unit's."""
    names: dict[str, str] = {}
    config: dict = {}
    for unit in StepProgram(layers).units():
        module = parts.modules[unit.role]
        if not isinstance(module, PeftExportable):
            continue
        own = {v.name for v in parts.variables[unit.role]}
        for local, name in module.peft_mapping(unit.layer).items():
            if local not in own or name in names.values():
                raise PluginError(f"model.{unit.role}: {type(module).__name__}'s peft_mapping gives {local} as "
                                  f"{name}, {'a name given twice' if local in own else 'not a variable of it'}")
            names[f"{unit}.{local}"] = name
        config.update(module.peft_config())
    return names, config


def adapter_stacks(parts, layers: int) -> dict[str, tuple]:
    """``{peft name: (make, sources)}`` of every peft tensor made of several adapter variables (a fused module's,
    from its component's optional ``peft_stacked(layer)`` and ``peft_stack``): ``sources`` the
    ``"<unit>.<variable>"`` names it reads, ``make(tensors)`` the tensor from those (by the same names)."""
    out: dict[str, tuple] = {}
    for unit in StepProgram(layers).units():
        module = parts.modules[unit.role]
        if not isinstance(module, PeftExportable):
            continue
        shapes = {v.name: tuple(v.shape) for v in parts.variables[unit.role]}
        for peft, local in module.peft_stacked(unit.layer).items():
            def make(read, unit=unit, module=module, peft=peft, local=local, shapes=shapes):
                return module.peft_stack(unit.layer, peft, {n: read[f"{unit}.{n}"] for n in local}, shapes)

            out[peft] = (make, [f"{unit}.{n}" for n in local])
    return out


def base_model(checkpoint: Path) -> str | None:
    """The Hugging Face directory the checkpoint's run started from (its saved ``model.hf_checkpoint``), for
    adapter_config.json's ``base_model_name_or_path``: only a name there, never read."""
    from ipuft.config.migrate import saved_config_data

    model = saved_config_data(checkpoint).get("model")
    source = model.get("hf_checkpoint") if isinstance(model, dict) else None
    return source if isinstance(source, str) else None


def write_adapter(checkpoint: Path, manifest: dict, cfg, parts, out: str | Path, dtype: str) -> Path:
    """Write the adapters of ``checkpoint`` (its verified ``manifest``, its config ``cfg`` and the model ``parts``
    built from it) as a peft adapter directory ``out``, in ``dtype``. :func:`ipuft.run.export.export_adapter`
    opens the checkpoint and builds the model."""
    from ipuft.io.safetensors import SafetensorsWriter

    torch_dtype = DTYPES[dtype]
    names, adapter = adapter_names(parts, cfg.model.layers)
    stacked = adapter_stacks(parts, cfg.model.layers)
    if not names and not stacked:
        raise CheckpointError(f"--adapter: model.adapter={cfg.model.adapter} of checkpoint {checkpoint} gives no "
                              f"variable a peft name (peft_mapping); export the whole model with --hf")
    reader = open_tensors(checkpoint, WEIGHTS, manifest)
    inputs = {n for _, sources in stacked.values() for n in sources}
    if missing := sorted((set(names) | inputs) - set(reader.keys())):
        raise CheckpointError(f"checkpoint {checkpoint} lacks {', '.join(missing[:5])}")
    order = sorted(names, key=lambda n: reader.entries[n].begin)  # one pass over the file
    config = {**adapter, "base_model_name_or_path": base_model(checkpoint), "revision": None}
    # A fused module's adapter (peft adapts Phi-3's qkv_proj as one) is made from several variables: they are
    # read first, and the stacked tensors (an adapter's rank by hidden, small) held until written.
    read = {n: reader.get(n) for n in sorted(inputs, key=lambda n: reader.entries[n].begin)}
    made = {peft: stack(read) for peft, (stack, _) in stacked.items()}
    with staged_directory(Path(out), "--adapter", [checkpoint], is_adapter_export) as tmp:
        specs = [VariableSpec(names[n], reader.entries[n].shape, torch_dtype) for n in order]
        specs += [VariableSpec(peft, tuple(t.shape), torch_dtype) for peft, t in made.items()]
        with SafetensorsWriter(tmp / TENSORS, specs, {"format": "pt"}) as writer:
            for name in order:
                writer.write(names[name], reader.get(name).to(torch_dtype))
            for peft, tensor in made.items():
                writer.write(peft, tensor.to(torch_dtype))
            writer.close()
        reader.finish()  # raises if the weights read were not the checkpoint's: nothing is left behind
        (tmp / CONFIG).write_text(json.dumps(config, indent=2))
    return Path(out)
