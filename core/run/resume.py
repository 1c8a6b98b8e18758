"""A run's state in its checkpoints: what :func:`save` writes of a training run, what :func:`restore` takes back
when it resumes, and the resume policy: a checkpoint whose run has nothing left to train, or whose config
differs from the resuming one in a key that would silently change the run (:data:`RESUME_KEYS`), is refused
before anything is built. The files themselves are :mod:`ipuft.io.checkpoint`'s format.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ipuft.config.identity import differences, model_keys
from ipuft.config.migrate import saved_config_data
from ipuft.config.sections import ConfigSectionRegistry
from ipuft.data.tokenizer import SAMPLE_TOKENIZER, tokenizer_path
from ipuft.errors import ConfigError
from ipuft.io.checkpoint import (
    OPTIM,
    SOURCE_FILES,
    TOKENIZER_FILES,
    WEIGHTS,
    Contents,
    checkpoint_initializer,
    find_checkpoint,
    read_meta,
    restore_rng,
    save_checkpoint,
)
from ipuft.io.model_files import home_files, model_home, read_directory_file

if TYPE_CHECKING:
    from ipuft.engine.phased import PhasedEngine

# What a resumed run must keep from the run it resumes besides its model (:func:`ipuft.config.identity.model_keys`),
# unless checkpoint.allow_changes lists the key.
RESUME_KEYS = (
    "model.precision", "training.global_batch_size", "training.optimizer.name", "training.master_weights",
    "training.stochastic_rounding", "execution.loss_scaling",
)  # fmt: skip


def resume_differences(cfg: DictConfig, checkpoint: Path, meta: dict,
                       sections: ConfigSectionRegistry | None = None) -> list[str]:
    """What would silently change if ``cfg`` resumed ``checkpoint``: each key of the model (``sections`` are the
    plugins' config sections, which with their families name its keys) and of :data:`RESUME_KEYS` that differs
    from the checkpoint's config, and optimizer state the checkpoint lacks."""
    saved = saved_config_data(checkpoint)
    allowed = set(cfg.checkpoint.allow_changes)
    found = [f"{key} {str(value)[:40]} -> {mine}"
             for key, value, mine in differences(saved, cfg, [*model_keys(cfg, sections), *RESUME_KEYS])
             if key not in allowed]
    if cfg.checkpoint.optim_state and not meta["optim_state"] and "checkpoint.optim_state" not in allowed:
        found.append("checkpoint.optim_state: the checkpoint has no optimizer state (Adam would restart from zero)")
    return found


def saved_optimizer(checkpoint: Path, meta: dict) -> str | None:
    """The optimizer whose state ``checkpoint`` holds: meta.json's ``optimizer``, or for a checkpoint written
    before it was recorded, its saved config's ``training.optimizer.name`` (the run's own, saved whole); None
    where neither says."""
    if isinstance(meta.get("optimizer"), str):
        return meta["optimizer"]
    training = saved_config_data(checkpoint).get("training")
    optimizer = training.get("optimizer") if isinstance(training, dict) else None
    name = optimizer.get("name") if isinstance(optimizer, dict) else None
    return name if isinstance(name, str) else None


def optimizer_mismatch(cfg: DictConfig, checkpoint: Path, meta: dict) -> str | None:
    """Why ``cfg`` cannot take ``checkpoint``'s optimizer state, whatever ``checkpoint.allow_changes`` says:
    another optimizer's state is not this one's (adamw8bit's 8-bit codes read as Adam's moments would train on
    garbage). None where it can, or where the state is not loaded (``checkpoint.optim_state=false``)."""
    saved = saved_optimizer(checkpoint, meta)
    mine = cfg.training.optimizer.name
    if not (cfg.checkpoint.optim_state and meta["optim_state"]) or saved is None or saved == mine:
        return None
    return (f"checkpoint.load: {checkpoint} holds the state of optimizer {saved}, which "
            f"training.optimizer.name={mine} cannot resume; resume with {saved}, or start {mine} from this run's "
            f"weights with model.init_checkpoint={checkpoint} (a new run, no checkpoint.load)")


def checkpoint_to_resume(cfg: DictConfig, sections: ConfigSectionRegistry | None = None) -> Path | None:
    """The checkpoint ``checkpoint.load`` resumes, if any, once the resume policy accepts it: it is short of
    ``training.steps`` and :func:`resume_differences` finds nothing."""
    if cfg.checkpoint.load is None:
        return None
    resumed = find_checkpoint(cfg.checkpoint.load)
    meta = read_meta(resumed)
    if meta["step"] >= cfg.training.steps:
        raise ConfigError(f"training.steps: {resumed} is at step {meta['step']} and training.steps="
                          f"{cfg.training.steps}, so there is nothing to train; raise training.steps")
    if problem := optimizer_mismatch(cfg, resumed, meta):
        raise ConfigError(problem)
    if changes := resume_differences(cfg, resumed, meta, sections):
        raise ConfigError(f"checkpoint.load: resuming {resumed} would change {'; '.join(changes)}; keep "
                          f"them, or list the keys in checkpoint.allow_changes to accept the change")
    return resumed


def run_files(cfg: DictConfig) -> dict[str, bytes]:
    """The model's own files a run's checkpoints carry: the source's (:data:`~ipuft.io.checkpoint.SOURCE_FILES`)
    from where the model comes from, and the tokenizer's (:data:`~ipuft.io.checkpoint.TOKENIZER_FILES`) from the
    run's tokenizer: ``data.tokenizer``'s directory (a lone file or the shipped sample: its tokenizer.json alone)
    where the data was tokenized with it, else the model's. Read and checked once, when the run starts, so that a
    bad file stops it before training."""
    files: dict[str, bytes] = {}
    home = model_home(cfg)
    if home is not None:
        files.update(home_files(home[0], SOURCE_FILES, f"{home[1]}: "))
    spec = cfg.data.tokenizer if cfg.data.path is not None else None
    if spec is None:
        if home is not None:
            files.update(home_files(home[0], TOKENIZER_FILES, f"{home[1]}: "))
    elif spec != SAMPLE_TOKENIZER and Path(spec).is_dir():
        files.update(home_files(Path(spec), TOKENIZER_FILES, "data.tokenizer: "))
    elif (path := tokenizer_path(spec)).is_file():
        files["tokenizer.json"] = read_directory_file(path.parent, "tokenizer.json", "data.tokenizer: ", path.name)
    return files


def save(engine: PhasedEngine, cfg: DictConfig, root: Path | None, step: int, data=None,
         model_files: dict[str, bytes] | None = None) -> Path | None:
    """Every rank takes part in gathering the full weights (and optimizer state), one tensor at a time; rank 0
    writes each into the checkpoint as it arrives (see :mod:`ipuft.io.checkpoint`), with the model's own files
    (``model_files``, read when the run started; by default :func:`run_files` now), so that an
    export or ``generate`` has the model's tokenizer and source config."""
    if root is None:
        return None
    groups = ("fwd", "optim") if cfg.checkpoint.optim_state else ("fwd",)
    tensors = engine.model.full_tensors(groups)
    if not engine.layout.is_main:
        for _ in tensors:  # this rank's part of each gather; rank 0 writes
            pass
        return None
    files = {"fwd": WEIGHTS, "optim": OPTIM}
    units = engine.program.units()
    contents = Contents(
        units=units,
        files={files[g]: [replace(s, name=f"{u}.{s.name}") for u in units for s in engine.model.full_specs(u, g)]
               for g in groups},
        tensors=((files[group], f"{unit}.{spec.name}", t) for unit, group, spec, t in tensors))
    state = {"optimizer": cfg.training.optimizer.name, "updates": engine.updates,
             "loss_scale": engine.scale.state_dict(),
             "data": data.state_dict() if hasattr(data, "state_dict") else {"step": step}}
    model_files = run_files(cfg) if model_files is None else model_files
    return save_checkpoint(contents, cfg, root, step, model_files, keep=cfg.checkpoint.to_keep, state=state)


def restore(engine: PhasedEngine, cfg: DictConfig, checkpoint: Path, data) -> int:
    """Resume a run's state from ``checkpoint`` (weights are already loaded); return its step."""
    meta = read_meta(checkpoint)
    if cfg.checkpoint.optim_state and meta.get("optim_state"):
        units = engine.program.units()
        # Verified as it is read; every state tensor of the dtype and shape this optimizer keeps.
        state_of = checkpoint_initializer(checkpoint, OPTIM, units=units, exact=cfg.training.optimizer.name)
        for unit in units:
            specs = engine.model.full_specs(unit, "optim")
            engine.model.load_full("optim", {unit: state_of(unit, specs, engine.model.full_homes(unit, "optim"))})
    engine.updates = int(meta.get("updates", meta["step"]))
    if "loss_scale" in meta:
        engine.scale.load_state_dict(meta["loss_scale"])
    if hasattr(data, "load_state_dict") and "rows" in meta.get("data", {}):
        data.load_state_dict(meta["data"])
    restore_rng(checkpoint)
    return int(meta["step"])
