"""The MNLI classification head module.

``forward(hidden)`` gives every position's 3-class logits ``[B, T, 3]``; ``forward(hidden, labels)`` the mean
cross-entropy over the micro-batch's rows, each row classified at its first labelled position (the one that
predicts the first target token) into the class that token names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ipuft.components import IGNORE_INDEX, Init, VariableSpec, has_values, specs_from_module
from ipuft.errors import DataError


class MNLIClassifier(torch.nn.Module):
    """``hidden[B, T, H] -> logits[B, T, 3]``, or the mean loss over rows when ``labels[B, T]`` are given."""

    # Its variables have no Hugging Face GPT-J counterpart: export leaves the head out.
    hf_exportable = False

    def __init__(self, hidden_size: int, label_token_ids: tuple[int, ...], layer_norm_epsilon: float = 1e-5) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden_size, eps=layer_norm_epsilon)
        self.proj = torch.nn.Linear(hidden_size, len(label_token_ids))
        self.label_token_ids = tuple(label_token_ids)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return self.proj(self.norm(hidden))
        position, classes = self.targets(labels)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        logits = self.proj(self.norm(hidden[rows, position]))
        # The loss and its softmax are float32 whatever the weights' precision.
        return F.cross_entropy(logits.float(), classes, ignore_index=IGNORE_INDEX)

    def targets(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's first labelled position ``[B]`` and its class ``[B]`` (``IGNORE_INDEX`` for a row with no
        label, which then does not count)."""
        labelled = labels != IGNORE_INDEX
        position = labelled.int().argmax(dim=1)  # the first labelled position (0 in a row without one)
        token = labels.gather(1, position[:, None]).squeeze(1)
        classes = torch.full_like(token, IGNORE_INDEX)
        for index, token_id in enumerate(self.label_token_ids):
            classes[token == token_id] = index
        unknown = labelled.any(dim=1) & (classes == IGNORE_INDEX)
        # ipuft plan and bench measure the head on tensors without values: nothing to check then.
        if has_values(labels) and unknown.any():
            row = int(unknown.nonzero()[0])
            raise DataError(f"mnli_classifier: row {row} of a micro-batch is labelled with token {int(token[row])} "
                            f"first, not one of the label tokens {list(self.label_token_ids)}; the head needs the "
                            f"mnli template's targets (plugins.mnli_head.label_token_ids)")
        return position, classes

    def variable_specs(self) -> list[VariableSpec]:
        inits = {"norm.weight": Init("ones"), "norm.bias": Init("zeros"), "proj.weight": Init("normal", 0.02),
                 "proj.bias": Init("zeros")}
        return specs_from_module(self, inits)

    def hf_mapping(self, layer: int | None = None) -> dict[str, str]:
        return {}


def accuracy(engine, dataset, micro_batch_size: int) -> dict:
    """``{"accuracy", "rows"}`` of an engine whose head is an :class:`MNLIClassifier` over every labelled row of
    ``dataset`` (a :class:`ipuft.data.tokens.TokenDataset`), once, in order, layer-major through the engine's units
    (:class:`ipuft.engine.inference.LayerMajor`); only each row's label position reaches the head."""
    from ipuft.engine.inference import LayerMajor

    runner = LayerMajor(engine)
    head = engine.modules["head"]
    correct = rows = 0
    for batch in dataset.eval_batches(micro_batch_size):
        for mb in range(batch.micro_batches):
            position, classes = head.targets(batch.labels[mb])
            logits = runner.head(runner.hidden(batch.input_ids[mb]), position[:, None])  # [B, 1, 3]
            counted = classes != IGNORE_INDEX
            predicted = logits[:, 0].argmax(-1).cpu()
            correct += int((predicted == classes)[counted].sum())
            rows += int(counted.sum())
    if rows == 0:
        raise DataError(f"{dataset.name}: no row has a label")
    return {"accuracy": correct / rows, "rows": rows}
