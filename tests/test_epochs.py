"""``training.epochs``: the steps that many passes over the data take, the schedule over them, the epoch in
every record, and a resume in the middle of an epoch that continues at the same row, bit for bit."""

import json
import math
import shutil

import pytest
import torch

from ipuft.config import load_config
from ipuft.data.tokens import data_source
from ipuft.errors import ConfigError
from ipuft.io.checkpoint import read_meta
from ipuft.run.schedule import learning_rate
from ipuft.run.train import train


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i}: the quick brown fox jumps over the lazy dog {i} " * 2})
                            + "\n" for i in range(5)))
    return path


def config(hooks, rows, *overrides):
    common = [f"data.path={rows}", "data.format=text", "data.tokenizer=sample", "model.embedding.vocab_size=512",
              "model.sequence_length=32", "training.global_batch_size=4",
              "training.optimizer.learning_rate.warmup_proportion=0.3", "training.optimizer.learning_rate.maximum=1e-3"]
    return load_config("tiny", [*common, *overrides], hooks.registrations.config_sections)


def test_epochs_run_the_steps_their_passes_take_with_the_schedule_over_them(hooks, rows, tmp_path):
    """``training.epochs=2`` over N rows in batches of 4 runs ceil(2N / 4) steps, exactly as that many
    ``training.steps`` would (the same rows, the same learning rates: the warm-up and decay follow the derived
    steps), and each record says how many passes its steps made."""
    cfg = config(hooks, rows, "training.epochs=2", f"output_dir={tmp_path}/epochs")
    n = len(data_source(cfg))
    steps = math.ceil(2 * n / 4)
    assert n == 10 and steps == 5  # 10 packed rows, so the last step takes two rows of the third pass's order
    records = train(cfg, hooks, progress=False)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["epoch"] for r in records] == [4 * s / n for s in range(1, steps + 1)]
    assert [r["lr"] for r in records] == [learning_rate(s, steps, cfg.training.optimizer.learning_rate)
                                          for s in range(steps)]
    same = train(config(hooks, rows, f"training.steps={steps}", f"output_dir={tmp_path}/steps"), hooks, progress=False)
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in same] == [(r["loss"], r["grad_norm"], r["lr"]) for r in records]
    # A fraction of a pass: the decimal as written (0.1 of 10 rows is one row, so one step).
    assert len(train(config(hooks, rows, "training.epochs=0.1", f"output_dir={tmp_path}/tenth"), hooks,
                     progress=False)) == 1


def test_a_resume_in_the_second_epoch_continues_at_the_same_row_bit_for_bit(hooks, rows, tmp_path):
    """Three passes (8 steps of 4 over 10 rows), saved at step 4 (1.6 passes, in the second epoch's shuffled
    order) and resumed from there: the resumed steps, their epochs and the final weights equal the run's."""
    full = train(config(hooks, rows, "training.epochs=3", f"output_dir={tmp_path}/full"), hooks, progress=False)
    train(config(hooks, rows, "training.epochs=3", "checkpoint.steps=4", f"output_dir={tmp_path}/cut"), hooks,
          progress=False)
    step4 = tmp_path / "step4"
    shutil.copytree(tmp_path / "cut" / "checkpoints" / "step-00000004", step4)
    assert read_meta(step4)["data"]["samples_seen"] == 16
    resumed = train(config(hooks, rows, "training.epochs=3", f"checkpoint.load={step4}",
                           f"output_dir={tmp_path}/resumed"), hooks, progress=False)
    assert [r["step"] for r in resumed] == [5, 6, 7, 8] and len(full) == 8
    assert [(r["loss"], r["grad_norm"], r["epoch"]) for r in resumed] == \
        [(r["loss"], r["grad_norm"], r["epoch"]) for r in full[4:]]
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / d / "checkpoints" / "step-00000008" / "model.safetensors"))
            for d in ("full", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("overrides", "message"), [
    (["training.epochs=2", "training.steps=3"], "training.epochs and training.steps: give one of them"),
    (["training.epochs=0"], "training.epochs: must be a number of passes over the data above 0"),
    (["training.epochs=nan"], "training.epochs: must be a number of passes over the data above 0"),
    (["training.epochs=2", "data.path=null"], "training.epochs: counts passes over data.path's rows"),
])
def test_bad_epochs_are_one_line(hooks, rows, overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(hooks, rows, *overrides)
