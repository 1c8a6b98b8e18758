"""A checkpoint's saved config, as this version of ipuft reads it.

A checkpoint's ``config.yaml`` is untrusted data: it is checked against the checkpoint's manifest, parsed
safely (:mod:`ipuft.config.safe_yaml`) and refused if it holds an interpolation. Keys that earlier versions
saved are migrated (:func:`migrate`; ``execution.activation_offload``'s true and false, all earlier versions
saved, are still two of its values): retired ones dropped, moved ones carried to their new place, and what a
saved config may not decide for the run that reads it (where that run writes, and where its weights come
from) removed. :func:`ipuft.config.load.checkpoint_config` loads the result as a preset.
"""

from __future__ import annotations

from pathlib import Path

from ipuft.config.safe_yaml import read_config_data, refuse_interpolations
from ipuft.config.sections import ConfigSectionRegistry
from ipuft.errors import CheckpointError
from ipuft.io.checkpoint import read_manifest, sha256_file

# What a checkpoint's config may not decide for the run that reads it: where that run writes (its spilled
# activations too), and where its weights come from (the checkpoint itself).
PLACEMENT = ("output_dir", "checkpoint.save", "model.init_checkpoint", "execution.spill_dir")

# Keys that earlier versions saved and that no longer exist: dropped from a checkpoint's config, so that its
# checkpoints stay loadable; and keys that moved, carried to their new place.
RETIRED = ("model.eval",)
MOVED = {f"training.optimizer.{key}": f"plugins.adamw.{key}" for key in ("beta1", "beta2", "eps", "weight_decay")}


def saved_value(saved: dict, key: str):
    """The value of dotted ``key`` in a parsed config mapping, or None where any part of it is missing."""
    node = saved
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _pop(data: dict, key: str):
    """Remove dotted ``key`` from nested ``data``; its value, or None."""
    parent = saved_value(data, key.rpartition(".")[0]) if "." in key else data
    return parent.pop(key.rpartition(".")[2], None) if isinstance(parent, dict) else None


def saved_config_data(checkpoint: Path) -> dict:
    """A checkpoint's config.yaml as data: checked against its manifest first, parsed safely, and refused if
    it holds an interpolation."""
    source = checkpoint / "config.yaml"
    if sha256_file(source) != read_manifest(checkpoint)["config.yaml"]:
        raise CheckpointError(f"checkpoint {checkpoint}: config.yaml does not match its checksum (corrupted)")
    data = read_config_data(source, f"checkpoint {checkpoint}: config.yaml")
    refuse_interpolations(data, str(source))
    return data


def migrate(data: dict, sections: ConfigSectionRegistry | None) -> None:
    """Bring a checkpoint's saved config ``data`` (parsed, in place) to this version's keys: moved keys to their
    new place, retired and :data:`PLACEMENT` keys dropped, and the plugin sections the saving run did not use
    dropped; ``sections`` are the installed plugins' config sections."""
    for old, new in MOVED.items():
        value = _pop(data, old)
        adamw = saved_value(data, "training.optimizer.name") == "adamw"
        if value is None or saved_value(data, new) is not None or not adamw:
            continue
        plugins = data.setdefault("plugins", {})
        section = plugins.setdefault(new.split(".")[1], {}) if isinstance(plugins, dict) else None
        if isinstance(section, dict):  # else the file is malformed there, and loading it says so in one line
            section[new.rpartition(".")[2]] = value
    for key in (*PLACEMENT, *RETIRED):
        _pop(data, key)
    # A saved config holds every plugin section installed when it was saved; one whose used_when that run did not
    # meet (plugins.adamw in a run of another optimizer) did nothing, and is not a setting of this config.
    saved_sections = data.get("plugins")
    for name in sections or ():
        when = sections.used_when(name)
        if isinstance(saved_sections, dict) and any(
                saved_value(data, key) is not None and str(saved_value(data, key)) != value
                for key, value in when.items()):
            saved_sections.pop(name, None)
