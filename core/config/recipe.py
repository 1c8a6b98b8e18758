"""The fine-tuning recipe of a checkpoint: what ``ipuft train model.hf_checkpoint=DIR`` (or
``model.init_checkpoint=RUN``) runs with when no ``--config`` chooses a preset.

The default preset (``small-cpu``) is a toy's recipe for a model from scratch: 64-token sequences at a learning
rate of 3e-3. A checkpoint given without a preset gets the ``finetune`` preset instead (a fine-tuning learning
rate, a warm-up, a cosine decay), and what the checkpoint and the device decide besides: the sequence length
(the checkpoint's positions, or the length of the run it starts from, at most :data:`MAX_SEQUENCE`) and the
precision (bfloat16, updated by stochastic rounding, where the device computes it fast; else float32). The run
prints one line naming the recipe and where each value came from (:func:`apply_recipe`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ipuft.config.identity import plain, saved_lookup
from ipuft.config.schema import Precision

PRESET = "finetune"
# The longest sequence the recipe trains on (the preset's model.sequence_length), where the checkpoint allows
# more: attention's cost and the activations grow with it, and 2048 tokens hold most fine-tuning examples.
MAX_SEQUENCE = 2048
CHECKPOINT_KEYS = ("model.hf_checkpoint", "model.init_checkpoint")
PREFERENCE_LEARNING_RATE = 1e-6  # data.format=preference: TRL's DPOTrainer's default
# The preset's keys the line names.
RECIPE_KEYS = (
    "training.optimizer.learning_rate.maximum", "training.optimizer.learning_rate.schedule",
    "training.optimizer.learning_rate.warmup_proportion", "training.global_batch_size", "training.steps",
    "data.path",
)  # fmt: skip


def wants_recipe(overrides: Iterable[tuple[str, Any]]) -> str | None:
    """The checkpoint key among parsed ``overrides`` that names a checkpoint, if any: with no ``--config``, the
    run takes this recipe."""
    return next((key for key, value in overrides if key in CHECKPOINT_KEYS and value not in (None, "")), None)


def apply_recipe(cfg: DictConfig, typed: set[str], checkpoint_key: str, positions: tuple[str, int] | None,
                 saved: dict | None) -> str:
    """Set what the recipe takes from the checkpoint and the device (keys the user typed stay theirs), and return
    the line that says so. ``positions``: the Hugging Face checkpoint's positions key and value, if it has one;
    ``saved``: the config of the run ``model.init_checkpoint`` starts from."""
    parts = [_sequence_length(cfg, typed, positions, saved), _precision(cfg, typed), *_pairs(cfg, typed)]
    told = {part.split("=")[0] for part in parts}  # (a value the recipe set is said once, with its reason)
    preset = [f"{key}={plain(OmegaConf.select(cfg, key))}" for key in RECIPE_KEYS if key not in typed | told]
    yours = [f"{key}={plain(OmegaConf.select(cfg, key))}" for key in RECIPE_KEYS if key in typed]
    if preset:
        parts.append(f"{', '.join(preset)} (the preset's)")
    if yours:
        parts.append(f"{', '.join(yours)} (yours)")
    return (f"recipe {PRESET}, as {checkpoint_key} is given without --config: {'; '.join(parts)}; "
            f"--config PRESET or KEY=VALUE sets any of them")


def _sequence_length(cfg: DictConfig, typed: set[str], positions: tuple[str, int] | None,
                     saved: dict | None) -> str:
    key = "model.sequence_length"
    if key in typed:
        return f"{key}={cfg.model.sequence_length} (yours)"
    if positions is not None:  # the Hugging Face import capped the preset's length at them
        return (f"{key}={cfg.model.sequence_length} (the checkpoint's {positions[0]}={positions[1]}, at most "
                f"{MAX_SEQUENCE})")
    trained = saved_lookup(saved, key) if saved is not None else None
    if isinstance(trained, int) and not isinstance(trained, bool) and trained > 0:
        cfg.model.sequence_length = min(trained, MAX_SEQUENCE)
        return (f"{key}={cfg.model.sequence_length} (the run it starts from trained at {trained}; at most "
                f"{MAX_SEQUENCE})")
    return f"{key}={cfg.model.sequence_length} (the preset's)"


def _pairs(cfg: DictConfig, typed: set[str]) -> list[str]:
    """Preference data: a micro-batch of one pair (two rows) where the preset's holds one row, and TRL's
    DPOTrainer's learning rate (1e-6), the preset's SFT rate being far too high for DPO, unless typed."""
    if str(getattr(cfg.data.format, "value", cfg.data.format)) != "preference":
        return []
    parts = []
    if "execution.micro_batch_size" not in typed and cfg.execution.micro_batch_size % 2:
        cfg.execution.micro_batch_size = 2 * cfg.execution.micro_batch_size
        parts.append(f"execution.micro_batch_size={cfg.execution.micro_batch_size} (whole pairs: two rows each)")
    key = "training.optimizer.learning_rate.maximum"
    if key not in typed:
        cfg.training.optimizer.learning_rate.maximum = PREFERENCE_LEARNING_RATE
        parts.append(f"{key}={PREFERENCE_LEARNING_RATE:g} (TRL's DPOTrainer's, for data.format=preference)")
    return parts


def _precision(cfg: DictConfig, typed: set[str]) -> str:
    if "model.precision" in typed:
        return f"model.precision={plain(cfg.model.precision)} (yours)"
    from ipuft.kernels import compute_device, fast_bfloat16

    fast, why = fast_bfloat16(compute_device(cfg))
    if not fast:
        return f"model.precision=float32 ({why})"
    cfg.model.precision = Precision.bfloat16
    recipe = ""
    if not {"training.stochastic_rounding", "training.master_weights"} & typed:
        cfg.training.stochastic_rounding = True  # round-to-nearest would lose updates under half a bfloat16 step
        recipe = " with training.stochastic_rounding=true"
    return f"model.precision=bfloat16{recipe} ({why})"
