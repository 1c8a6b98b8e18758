"""The step's loss weights every trained token of the step alike (#43 item 8): the sum over the trained tokens of
every micro-batch and DP rank over their count, as transformers' Trainer (``num_items_in_batch``) and TRL weight
it. On rows with unequal masks GA=4 × 2 rows equals GA=1 × 8 rows and DP=2 equals one process, loss and every
gradient; the step-1 loss is the plain token-weighted mean, not the mean of the micro-batches' means."""

from pathlib import Path

import pytest
import torch
from distributed import spawn
from test_engine import batches, make_engine

from ipuft.components import IGNORE_INDEX
from ipuft.data.batch import Batch
from ipuft.engine.inference import LayerMajor

ROWS = 8
# Trained tokens per row of the tiny preset's 8: micro-batches of 2 rows hold 1, 16, 4 and 15 (the first row all
# ignored: a row with nothing to learn, as a chat row of a system prompt alone).
KEEP = (0, 1, 8, 8, 3, 1, 7, 8)
SHAPE = ("training.global_batch_size=8", "training.optimizer.gradient_clipping=0.05")


def rows(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Eight rows of token ids and their labels, row i's last ``KEEP[i]`` labels trained and the rest ignored."""
    batch = batches(cfg)[0]
    ids, labels = batch.input_ids.flatten(0, 1), batch.labels.flatten(0, 1).clone()
    assert ids.shape[0] == ROWS and labels.shape[1] >= max(KEEP)
    for i, keep in enumerate(KEEP):
        labels[i, : labels.shape[1] - keep] = IGNORE_INDEX
    return ids, labels


def as_batch(ids: torch.Tensor, labels: torch.Tensor, rows_per_micro_batch: int) -> Batch:
    return Batch(ids.view(-1, rows_per_micro_batch, ids.shape[1]), labels.view(-1, rows_per_micro_batch, ids.shape[1]))


def step(cfg, hooks, ids, labels, micro: int):
    engine = make_engine(cfg, hooks)
    result = engine.step(as_batch(ids, labels, micro), 1e-3)
    return result, engine.store.state("grad"), engine.model.weights()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("chunk", [0, 512])
def test_ga4_of_two_rows_equals_ga1_of_eight_on_masked_rows(hooks, make_config, chunk):
    """Loss, gradient norm (clipping active), every stored gradient and every updated weight: GA=4 × 2 rows and
    GA=8 × 1 row (its first micro-batch without a trained token: it weighs nothing, and its loss, a mean over no
    token, is 0 with a zero gradient, not 0 / 0) as GA=1 × 8 rows, within float32 rounding; and the loss is the
    plain token-weighted mean of the step's tokens, which the mean of the micro-batches' means is not."""
    runs = {}
    for micro in (1, 2, 8):
        cfg = make_config(*SHAPE, f"execution.micro_batch_size={micro}", f"execution.head_chunk_tokens={chunk}")
        ids, labels = rows(cfg)
        runs[micro] = step(cfg, hooks, ids, labels, micro)
    one, grads1, weights1 = runs[8]
    assert one.grad_norm > 0.05  # clipping is active
    for micro in (1, 2):
        many, grads, weights = runs[micro]
        assert not many.skipped
        assert many.loss == pytest.approx(one.loss, rel=1e-6)
        assert many.grad_norm == pytest.approx(one.grad_norm, rel=1e-6)
        # GA=8 sums a gradient in eight parts: Adam's first step divides each element by its own magnitude, so
        # an element near eps moves by its rounding (fc_in.bias: 2.2e-5 of the largest); its gradients are
        # within 1e-5, and the updated weights are compared at GA=4.
        for got, want in ((grads, grads1), (weights, weights1))[: 2 if micro == 2 else 1]:
            assert got.keys() == want.keys()
            for unit, tensors in want.items():
                for name, t in tensors.items():
                    assert rel(got[unit][name], t) <= 1e-5, (micro, unit, name)

    # The plain reference: each micro-batch's summed token loss through the evaluation path, before the step.
    cfg = make_config(*SHAPE, "execution.micro_batch_size=2")
    ids, labels = rows(cfg)
    runner = LayerMajor(make_engine(cfg, hooks).model)
    sums = [runner.loss_sum(ids[i : i + 2], labels[i : i + 2]) for i in range(0, ROWS, 2)]
    weighted = sum(s for s, _ in sums) / sum(n for _, n in sums)
    means = sum(float(s) / n for s, n in sums) / len(sums)
    assert one.loss == pytest.approx(float(weighted), rel=1e-6)
    assert abs(means - float(weighted)) > 1e-3 * float(weighted)  # what the loss was: the mean of the means


def test_packed_rows_weigh_each_micro_batch_alike(hooks, make_config):
    """Every label trained (equal counts): each micro-batch's weight is exactly 1 / GA, as before."""
    from ipuft.engine.phased import token_weights

    cfg = make_config(*SHAPE, "execution.micro_batch_size=2")
    assert token_weights(batches(cfg)[0].labels) == [0.25] * 4
    _, labels = rows(cfg)
    assert token_weights(labels.view(4, 2, -1)) == [n / 36 for n in (1, 16, 4, 15)]


def dp_step(rank: int, out: str) -> None:
    """DP=2 (Gloo), 2 micro-batches of 2 rows each: rank r takes micro-batches r and r + 2 of the masked rows."""
    from ipuft.config import load_config
    from ipuft.plugins import create_plugin_manager
    from ipuft.run.runtime import build_engine

    hooks = create_plugin_manager()
    cfg = load_config("tiny", [*SHAPE, "execution.micro_batch_size=2", "execution.data_parallel=2"],
                      hooks.registrations.config_sections)
    engine = build_engine(cfg, hooks)
    ids, labels = rows(cfg)
    mine = [m for m in range(4) if m % 2 == rank]
    batch = as_batch(ids, labels, 2)
    result = engine.step(Batch(batch.input_ids[mine], batch.labels[mine]), 1e-3)
    weights = engine.model.full_weights()
    if rank == 0:
        from dist_workers import plain

        torch.save(plain({"loss": result.loss, "norm": result.grad_norm, "weights": weights}), Path(out) / "dp.pt")


def test_dp2_equals_one_process_on_masked_rows(hooks, make_config, tmp_path):
    """Rank 0 holds micro-batches of 1 and 4 trained tokens, rank 1 of 16 and 15: loss, norm and the updated
    weights as one process's GA=4."""
    spawn(2, dp_step, str(tmp_path), tmp=tmp_path)
    saved = torch.load(tmp_path / "dp.pt")
    cfg = make_config(*SHAPE, "execution.micro_batch_size=2")
    ids, labels = rows(cfg)
    engine = make_engine(cfg, hooks)
    one = engine.step(as_batch(ids, labels, 2), 1e-3)
    assert saved["loss"] == pytest.approx(one.loss, rel=1e-6)
    assert saved["norm"] == pytest.approx(one.grad_norm, rel=1e-6)
    want = engine.model.full_weights()
    for unit, tensors in want.items():
        for name, t in tensors.items():
            assert rel(saved["weights"][unit][name], t) <= 1e-5, (unit, name)


def test_a_step_without_a_trained_token_is_skipped(hooks, make_config):
    """Every label ignored: the loss is not a number and the step is skipped, weights and state untouched (an
    update from no data would still decay the weights and move the moments)."""
    cfg = make_config(*SHAPE, "execution.micro_batch_size=2")
    ids, labels = rows(cfg)
    engine = make_engine(cfg, hooks)
    before = engine.model.full_weights()
    result = engine.step(as_batch(ids, torch.full_like(labels, IGNORE_INDEX), 2), 1e-3)
    assert result.skipped and result.loss != result.loss
    after = engine.model.full_weights()
    for unit, tensors in before.items():
        for name, t in tensors.items():
            assert torch.equal(after[unit][name], t), (unit, name)
