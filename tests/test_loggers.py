"""Logging backends: the hook, the shipped TensorBoard backend read back with tensorboard's own reader, and
backends that fail without stopping training."""

import json
from typing import ClassVar

import pytest

from ipuft import hookimpl
from ipuft.config import load_config
from ipuft.config.rules import check_plugins
from ipuft.errors import PluginError
from ipuft.loggers import Logger
from ipuft.plugins import create_plugin_manager
from ipuft.run.train import train

RUN = ["training.steps=3", "training.global_batch_size=2"]


def run(hooks, tmp_path, *overrides):
    cfg = load_config("tiny", [*RUN, f"output_dir={tmp_path}/run", *overrides], hooks.registrations.config_sections)
    check_plugins(cfg, hooks.registrations)
    return train(cfg, hooks, progress=False)


def test_tensorboard_event_files_hold_the_same_losses_as_metrics(hooks, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = run(hooks, tmp_path, "logging.backends=[jsonl,tensorboard]")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert "loss" in events.Tags()["scalars"] and "traffic/h2d/fwd" in events.Tags()["scalars"]
    losses = [(e.step, e.value) for e in events.Scalars("loss")]
    # event files store float32: the same values as metrics.jsonl, to float32
    assert losses == [(r["step"], pytest.approx(r["loss"], rel=1e-7)) for r in records]
    assert [e.value for e in events.Scalars("grad_norm")] == [pytest.approx(r["grad_norm"], rel=1e-7) for r in records]
    on_disk = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert on_disk == [r["loss"] for r in records]  # jsonl stays built in


class Recorder(Logger):
    calls: ClassVar[list] = []

    def start(self, config):
        Recorder.calls.append(("start", config["training"]["steps"]))

    def log(self, step, record):
        Recorder.calls.append(("log", step, record["loss"]))

    def finish(self, status):
        Recorder.calls.append(("finish", status))


class Broken(Logger):
    def start(self, config):
        pass

    def log(self, step, record):
        if step == 2:
            raise ConnectionError("the dashboard went away")

    def finish(self, status):
        raise AssertionError("a dropped backend is not called again")


class Backends:
    @hookimpl
    def ipuft_register_loggers(self, registry):
        registry.add("recorder", lambda cfg, run_dir: Recorder())
        registry.add("broken", lambda cfg, run_dir: Broken())
        registry.add("unbuildable", lambda cfg, run_dir: 1 / 0)


def test_a_backend_gets_the_config_every_step_and_the_end_and_a_failing_one_is_one_warning(tmp_path, capsys):
    hooks = create_plugin_manager(extra_plugins=[("test_backends", Backends())])
    Recorder.calls = []
    records = run(hooks, tmp_path, "logging.backends=[recorder,broken,unbuildable]")
    assert [r["step"] for r in records] == [1, 2, 3]  # training went on
    assert Recorder.calls == [("start", 3), *[("log", r["step"], r["loss"]) for r in records], ("finish", "finished")]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ipuft: warning:")]
    assert warnings == [
        "ipuft: warning: logging backend 'unbuildable' failed and is off for this run: ZeroDivisionError: division by zero",
        "ipuft: warning: logging backend 'broken' failed and is off for this run: ConnectionError: the dashboard went away",
    ]


def test_a_backend_whose_package_is_missing_is_one_warning(hooks, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if ipuft[wandb] were not installed
    records = run(hooks, tmp_path, "logging.backends=[jsonl,wandb]")
    assert len(records) == 3
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == ("ipuft: warning: logging backend 'wandb' failed and is off for this run: "
                                    "ImportError: wandb is not installed; pip install 'ipuft[wandb]'")


def test_an_unknown_backend_is_one_line(hooks):
    cfg = load_config("tiny", ["logging.backends=[jsonl,mlflow]"], hooks.registrations.config_sections)
    with pytest.raises(PluginError, match=r"^logging.backends: unknown logging backend 'mlflow'; available: "
                                          r"tensorboard, wandb$"):
        check_plugins(cfg, hooks.registrations)
