"""Loss scaling: the factor gradients carry until the optimizer removes it.

Static (the reference's default; 4096 with float16) or dynamic: an overflow (a non-finite gradient norm)
halves the scale and the step is skipped; ``growth_interval`` clean steps in a row double it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from omegaconf import DictConfig


@dataclass
class LossScale:
    """The current scale and, when dynamic, the clean steps since the last change."""

    scale: float
    dynamic: bool = False
    growth_interval: int = 1000
    clean_steps: int = 0

    @classmethod
    def from_config(cls, cfg: DictConfig) -> LossScale:
        e = cfg.execution
        if e.loss_scaling == "dynamic":
            return cls(float(e.loss_scaling_initial), True, int(e.loss_scaling_growth_interval))
        return cls(float(e.loss_scaling))

    def update(self, overflow: bool) -> None:
        """After a step: halve on overflow, double after ``growth_interval`` clean steps (dynamic only)."""
        if not self.dynamic:
            return
        if overflow:
            self.scale /= 2.0
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= 2.0
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.dynamic = float(state["scale"]), bool(state["dynamic"])
        self.growth_interval, self.clean_steps = int(state["growth_interval"]), int(state["clean_steps"])
