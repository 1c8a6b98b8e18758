"""The training loop and ``ipuft train``: run directory, metrics, schedules, sample data."""

import itertools
import json
import math

import pytest
import yaml
from cli_helpers import run_cli as cli
from omegaconf import OmegaConf

from ipuft.config import checkpoint_config
from ipuft.data.synthetic import SampleData
from ipuft.plugins import create_plugin_manager
from ipuft.run.schedule import learning_rate

METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "h2d_bytes", "d2h_bytes", "device_peak_bytes"}




def read_metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_config_and_metrics(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = cli(capsys, "train", "--config", "tiny", "training.steps=3", f"output_dir={out}",
                       "training.optimizer.learning_rate.maximum=1e-3")
    assert code == 0, err
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r.keys() >= METRIC_KEYS
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["h2d_bytes"] > 0 and r["device_peak_bytes"] > 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["training"]["steps"] == 3 and saved["output_dir"] == str(out)
    assert saved["gradient_accumulation"] == 16


def test_a_run_builds_its_optimizer_once(hooks, make_config, tmp_path, monkeypatch):
    # The model rules, the check that a checkpoint of the optimizer's state fits, and the engine share the run's
    # one optimizer: counted where the registrations build it.
    from ipuft.run.train import train

    registrations, built = hooks.registrations, []
    build = registrations.build_optimizer
    monkeypatch.setattr(registrations, "build_optimizer", lambda cfg: built.append(build(cfg)) or built[-1])
    cfg = make_config("training.steps=1", "training.global_batch_size=2", "checkpoint.optim_state=true",
                      f"output_dir={tmp_path / 'run'}")
    records = train(cfg, hooks, progress=False)
    assert len(built) == 1 and [r["step"] for r in records] == [1]


def test_train_refuses_a_directory_holding_a_run(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    code, _, err = cli(capsys, "train", "--config", "tiny", "training.steps=1", f"output_dir={out}")
    assert code == 2 and "already holds a run" in err
    assert (out / "metrics.jsonl").read_text() == "precious\n"


@pytest.mark.slow
def test_default_train_visibly_learns(tmp_path, capsys, monkeypatch):
    """``ipuft train`` with no arguments: the small-cpu preset on the sample data."""
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "train")
    assert code == 0, err
    (run,) = (tmp_path / "runs").iterdir()
    losses = [r["loss"] for r in read_metrics(run)]
    assert len(losses) == OmegaConf.load(run / "config.yaml").training.steps
    assert losses[0] > 5.0  # about ln(256) at initialisation
    assert max(losses[-5:]) < 0.4 * losses[0]


def lr_cfg(schedule, warmup=0.2, maximum=1e-3):
    from ipuft.config.schema import LearningRateConfig, Schedule

    return OmegaConf.structured(LearningRateConfig(maximum, warmup, Schedule(schedule)))


def test_reference_schedule_warms_up_linearly_from_1e_7_then_stays():
    lrs = [learning_rate(s, 10, lr_cfg("constant", warmup=0.5)) for s in range(10)]
    assert lrs[0] == pytest.approx(1e-7)
    assert lrs[1:5] == pytest.approx([1e-7 + (1e-3 - 1e-7) * k / 4 for k in range(1, 5)])
    assert lrs[4:] == pytest.approx([1e-3] * 6)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decay_schedules(schedule):
    lrs = [learning_rate(s, 100, lr_cfg(schedule, warmup=0.1)) for s in range(100)]
    assert lrs[10] == pytest.approx(1e-3)
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert lrs[55] == pytest.approx(5e-4, rel=1e-9)  # halfway through the decay, for both shapes
    assert lrs[99] < 2e-5


def test_sample_data_is_deterministic_and_shifted():
    data = SampleData(vocab_size=100, sequence_length=16, seed=3)
    a, b = data.rows(5, 4), SampleData(100, 16, 3).rows(5, 4)
    assert a.shape == (4, 17) and a.equal(b)
    assert not a.equal(data.rows(6, 4))
    batch = data.batch(5, global_batch_size=4, micro_batch_size=2)
    assert batch.input_ids.shape == (2, 2, 16)
    assert batch.input_ids.reshape(4, 16).equal(a[:, :-1]) and batch.labels.reshape(4, 16).equal(a[:, 1:])
    assert int(a.max()) < 100 and int(a.min()) >= 0


def test_bench_reports_throughput(capsys):
    code, out, err = cli(capsys, "bench", "--config", "tiny", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["tokens_per_s"] == pytest.approx(result["samples_per_s"] * 8)
    assert result["duration_s"] > 0 and result["device"] == "cpu"
    assert "profile" not in result  # only with --profile (tests/test_profiling.py)


def test_train_with_a_swapped_optimizer_through_config_alone(fake_dist, tmp_path, capsys):
    fake_dist("ipuft-test-sgd", {"sgd": "ipuft_test_sgd"})
    out = tmp_path / "sgd"
    code, _, err = cli(capsys, "train", "--config", "tiny", "training.optimizer.name=sgd", "plugins.sgd.momentum=0.5",
                       "training.optimizer.learning_rate.maximum=0.5", "training.steps=8", f"output_dir={out}")
    assert code == 0, err
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.05
    saved = yaml.safe_load((out / "config.yaml").read_text())["plugins"]
    assert saved["sgd"] == {"momentum": 0.5}
    # The saved config holds plugins.adamw too, which did nothing in this run: loading the checkpoint (eval,
    # generate, init_checkpoint) does not take it for a setting made while another optimizer is selected.
    assert "adamw" in saved
    cfg = checkpoint_config(out, create_plugin_manager().registrations.config_sections)
    assert cfg.training.optimizer.name == "sgd" and cfg.plugins.sgd.momentum == 0.5


def test_validation_loss_every_eval_steps_equals_ipuft_eval_on_the_same_rows(tmp_path, capsys):
    rows = [{"premise": f"a cat number {i} sleeps on the mat", "hypothesis": "a cat rests", "label": i % 3}
            for i in range(30)]
    validation = tmp_path / "val.jsonl"
    validation.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    code, _, err = cli(capsys, "train", "training.steps=5", "training.eval_steps=2", "checkpoint.steps=2",
                       f"data.validation_path={validation}", f"output_dir={out}")
    assert code == 0, err
    records = read_metrics(out)
    # every eval_steps steps, and at the last step
    assert [r["step"] for r in records if "validation_loss" in r] == [2, 4, 5]
    for record in records:
        if "validation_loss" not in record:
            continue
        checkpoint = out / "checkpoints" / f"step-{record['step']:08d}"
        for extra in ([f"data.path={validation}"], []):  # the file, or the run's own validation split
            code, printed, err = cli(capsys, "eval", "--checkpoint", str(checkpoint), *extra, "--json")
            assert code == 0, err
            scored = json.loads(printed)
            assert scored["loss"] == record["validation_loss"]
            assert scored["perplexity"] == record["validation_perplexity"]
            assert scored["tokens"] == record["validation_tokens"] > 0
    assert records[-1]["validation_loss"] < records[1]["validation_loss"]  # it learns


def test_eval_steps_needs_validation_rows(tmp_path, capsys):
    code, _, err = cli(capsys, "train", "training.eval_steps=2", f"output_dir={tmp_path}/run")
    assert code == 2
    assert err == ("ipuft: error: training.eval_steps: evaluates on data.validation_path, data.validation_split or "
                   "data.validation_fraction; set one of them (or eval_steps=0)\n")


def test_a_validation_fraction_is_held_out_of_training_and_scored(tmp_path, capsys, hooks):
    from ipuft.config import load_config
    from ipuft.data.tokens import data_source, validation_source

    overrides = ["data.validation_fraction=0.2", "training.steps=3", "training.eval_steps=3"]
    cfg = load_config("small-cpu", overrides, hooks.registrations.config_sections)
    train_rows, held_out = data_source(cfg), validation_source(cfg)
    assert held_out is not None and len(held_out) == round(0.2 * (len(train_rows) + len(held_out)))
    served = set(train_rows.table.tolist())
    assert served.isdisjoint(held_out.table.tolist())  # training never sees a validation row
    assert served | set(held_out.table.tolist()) == set(range(len(train_rows) + len(held_out)))
    assert torch_equal_rows(held_out, validation_source(cfg))  # deterministic: the same split every time
    out = tmp_path / "run"
    code, _, err = cli(capsys, "train", *overrides, f"output_dir={out}")
    assert code == 0, err
    last = read_metrics(out)[-1]
    assert last["validation_tokens"] == len(held_out) * cfg.model.sequence_length  # packed: every token counts
    code, printed, err = cli(capsys, "eval", "--checkpoint", str(out), "--json")
    assert code == 0, err
    assert json.loads(printed)["loss"] == last["validation_loss"]


def torch_equal_rows(a, b):
    return len(a) == len(b) and all(bool((a.row(i)[0] == b.row(i)[0]).all()) for i in range(len(a)))
