"""Checkpoints: exact resume, resume under another layout, loss scaling and skips, signals, kills."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import dist_workers
import pytest
import torch
from distributed import spawn

from ipuft.config import load_config
from ipuft.errors import CheckpointError, TrainingError
from ipuft.io.checkpoint import (
    checkpoint_initializer,
    checkpoints,
    find_checkpoint,
    read_meta,
    verify,
)
from ipuft.run.runtime import build_engine
from ipuft.run.train import train

MNLI = ["data.path=mnli-sample", "data.tokenizer=sample", "model.embedding.vocab_size=512",
        "model.sequence_length=32", "training.global_batch_size=4", "training.optimizer.learning_rate.maximum=1e-3",
        "training.optimizer.learning_rate.warmup_proportion=0.3", "training.optimizer.learning_rate.schedule=cosine"]


def run(hooks, *overrides):
    return train(load_config("tiny", [*MNLI, *overrides], hooks.registrations.config_sections), hooks, progress=False)


def final_weights(run_dir):
    ckpt = find_checkpoint(run_dir)
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors")), load_file(str(ckpt / "optim.safetensors"))


PRECISIONS = {
    "float32": [],
    "bf16-sr": ["model.precision=bfloat16", "training.stochastic_rounding=true"],
    "fp16-master-dynamic": ["model.precision=float16", "training.master_weights=true", "execution.loss_scaling=dynamic",
                            "execution.loss_scaling_growth_interval=2"],
    "bf16-sr-tied": ["model.precision=bfloat16", "training.stochastic_rounding=true", "model.tie_embeddings=true"],
}


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_exact_resume_is_bit_identical(hooks, tmp_path, precision):
    recipe = PRECISIONS[precision]
    full = run(hooks, "training.steps=6", f"output_dir={tmp_path}/full", *recipe)
    run(hooks, "training.steps=6", "checkpoint.steps=3", f"output_dir={tmp_path}/crashed", *recipe)
    # The run "crashed" after its step-3 checkpoint: keep only that one and resume from it.
    step3 = tmp_path / "step3"
    shutil.copytree(tmp_path / "crashed" / "checkpoints" / "step-00000003", step3)
    assert read_meta(step3)["step"] == 3 and read_meta(step3)["data"]["samples_seen"] == 12
    weights, optim = final_weights(step3)
    dtype = {"float32": torch.float32, "bf16-sr": torch.bfloat16, "fp16-master-dynamic": torch.float16,
             "bf16-sr-tied": torch.bfloat16}[precision]
    assert ("head.proj.weight" in weights) == ("tied" not in precision)  # a tied model stores its matrix once
    assert all(t.dtype == dtype for t in weights.values())  # checkpoints keep the training dtype ...
    assert all(t.dtype == torch.float32 for t in optim.values())
    assert any(k.endswith(".master") for k in optim) == ("master" in precision)  # ... and the master copy
    resumed = run(hooks, "training.steps=6", f"checkpoint.load={step3}", f"output_dir={tmp_path}/resumed", *recipe)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full[3:]]
    for a, b in zip(final_weights(tmp_path / "full"), final_weights(tmp_path / "resumed")):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_latest_in_the_same_run_directory_keeps_its_metrics(hooks, tmp_path):
    out = tmp_path / "run"
    run(hooks, "training.steps=2", f"output_dir={out}")
    run(hooks, "training.steps=4", "checkpoint.load=latest", f"output_dir={out}")
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert [c.name for c in checkpoints(out / "checkpoints")] == ["step-00000002", "step-00000004"]


@pytest.mark.parametrize("direction", ["parallel_to_single", "single_to_parallel"])
def test_resume_under_another_layout(hooks, tmp_path, direction):
    base = ["model.embedding.vocab_size=100", "execution.micro_batch_size=1", "training.global_batch_size=4",
            "training.steps=5", "training.optimizer.learning_rate.maximum=2e-3", "plugins.adamw.eps=1e-4"]
    parallel = ["execution.data_parallel=2", "execution.tensor_parallel=2", "execution.rts=true"]
    reference = train(load_config("tiny", [*base, f"output_dir={tmp_path}/ref"], hooks.registrations.config_sections),
                      hooks, progress=False)
    first, second = (parallel, []) if direction == "parallel_to_single" else ([], parallel)
    first_cfg = [*base, *first, "checkpoint.steps=3", f"output_dir={tmp_path}/first"]
    if first:
        spawn(4, dist_workers.train_run, first_cfg, tmp=tmp_path)
    else:
        train(load_config("tiny", first_cfg, hooks.registrations.config_sections), hooks, progress=False)
    step3 = tmp_path / "first" / "checkpoints" / "step-00000003"
    second_cfg = [*base, *second, f"checkpoint.load={step3}", f"output_dir={tmp_path}/second"]
    if second:
        spawn(4, dist_workers.train_run, second_cfg, tmp=tmp_path)
    else:
        train(load_config("tiny", second_cfg, hooks.registrations.config_sections), hooks, progress=False)
    resumed = [json.loads(line) for line in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [4, 5]
    for got, want in zip(resumed, reference[3:], strict=True):
        assert abs(got["loss"] - want["loss"]) / want["loss"] <= 1e-5
        assert abs(got["grad_norm"] - want["grad_norm"]) / want["grad_norm"] <= 1e-5


def test_dynamic_loss_scaling_skips_and_rescales(hooks):
    cfg = load_config("tiny", ["execution.loss_scaling=dynamic", "execution.loss_scaling_initial=1024",
                               "execution.loss_scaling_growth_interval=2", "training.global_batch_size=2"],
                      hooks.registrations.config_sections)
    engine = build_engine(cfg, hooks)
    from ipuft.data.tokens import data_source

    data = data_source(cfg)
    batches = [data.batch(s, 2, 1) for s in range(5)]
    overflow_at = {2}
    add = engine._add_to_norm
    calls = {"step": 0}

    def add_to_norm(placed, grads, st):
        add(placed, grads, st)
        if calls["step"] in overflow_at:
            st.norm_sq += float("inf")

    engine._add_to_norm = add_to_norm
    scales, skipped = [], []
    for s, batch in enumerate(batches, start=1):
        calls["step"] = s
        before = {u: {n: t.clone() for n, t in w.items()} for u, w in engine.model.weights().items()}
        optim = {u: {n: t.clone() for n, t in w.items()} for u, w in engine.store.state("optim").items()}
        result = engine.step(batch, 1e-3)
        scales.append(result.loss_scale)
        skipped.append(result.skipped)
        unchanged = all(torch.equal(t, before[u][n]) for u, w in engine.model.weights().items() for n, t in w.items())
        optim_unchanged = all(torch.equal(t, optim[u][n]) for u, w in engine.store.state("optim").items()
                              for n, t in w.items())
        assert unchanged == optim_unchanged == result.skipped
    assert skipped == [False, True, False, False, False]
    assert scales == [1024, 1024, 512, 512, 1024]  # halved on overflow, doubled after 2 clean steps
    assert engine.updates == 4  # Adam's step count ignores the skipped step


def test_consecutive_skips_stop_the_run(hooks, tmp_path, monkeypatch):
    from ipuft.engine import phased as engine_module

    def always_overflow(self, placed, grads, st):
        st.norm_sq += float("nan")

    monkeypatch.setattr(engine_module.PhasedEngine, "_add_to_norm", always_overflow)
    cfg = load_config("tiny", ["training.steps=20", "training.max_consecutive_skips=3", "training.global_batch_size=2",
                               f"output_dir={tmp_path}/run"], hooks.registrations.config_sections)
    with pytest.raises(TrainingError, match=r"3 optimizer steps in a row were skipped .*\(last at step 3\)"):
        train(cfg, hooks, progress=False)


def _env():
    # The same thread count as this process, so that float sums match bit for bit.
    return {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}


def _wait_for_steps(out, proc, n, timeout=90):
    deadline = time.time() + timeout
    while True:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.stderr.read()
        assert time.time() < deadline, "training did not progress"
        time.sleep(0.1)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_then_resume_continues_exactly(hooks, tmp_path, signum, code):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "ipuft.cli.main", "train", "--config", "tiny", *MNLI,
            "training.optimizer.learning_rate.schedule=constant", "training.optimizer.learning_rate.warmup_proportion=0"]
    proc = subprocess.Popen([*args, "training.steps=100000", f"output_dir={out}"], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for_steps(out, proc, 2)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"ipuft: error: stopped by {signal.Signals(signum).name} after step ")
    done = read_meta(find_checkpoint(out))["step"]
    assert done >= 2 and f"after step {done};" in last
    # Resume in the same run directory for two more steps; compare with an uninterrupted run.
    common = ["training.optimizer.learning_rate.schedule=constant", "training.optimizer.learning_rate.warmup_proportion=0"]
    resumed = run(hooks, *common, f"training.steps={done + 2}", "checkpoint.load=latest", f"output_dir={out}")
    straight = run(hooks, *common, f"training.steps={done + 2}", f"output_dir={tmp_path}/straight")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[done:]]
    for a, b in zip(final_weights(out), final_weights(tmp_path / "straight")):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigkill_during_saves_never_breaks_the_latest_checkpoint(tmp_path):
    """Checkpoints are written every step; kill the trainer at random moments, ten times."""
    out = tmp_path / "run"
    rng = random.Random(0)
    args = [sys.executable, "-m", "ipuft.cli.main", "train", "--config", "tiny", "training.global_batch_size=2",
            "training.steps=100000", "checkpoint.steps=1", "checkpoint.to_keep=2", f"output_dir={out}"]
    for trial in range(10):
        resume = ["checkpoint.load=latest"] if trial else []
        proc = subprocess.Popen([*args, *resume], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        _wait_for_steps(out, proc, trial + 2, timeout=120)
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        latest = find_checkpoint(out)  # never a half-written directory under a final name
        meta = read_meta(latest)
        verify(latest)  # every file matches the manifest's checksums
        initial = checkpoint_initializer(latest)
        from ipuft.components import VariableSpec

        assert initial("head", [VariableSpec("norm.weight", (64,))])["norm.weight"].shape == (64,)
        assert meta["step"] >= trial + 1
        assert len(list((out / "checkpoints").glob(".tmp-step-*"))) <= 1  # a killed writer's leftovers are cleared


def test_a_torn_metrics_line_does_not_stop_a_resume(hooks, tmp_path):
    out = tmp_path / "run"
    run(hooks, "training.steps=2", f"output_dir={out}")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 1.')  # killed mid-write
    run(hooks, "training.steps=3", "checkpoint.load=latest", f"output_dir={out}")
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_a_corrupted_checkpoint_is_refused(hooks, tmp_path):
    run(hooks, "training.steps=1", f"output_dir={tmp_path}/run")
    ckpt = find_checkpoint(tmp_path / "run")
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    # The file is verified as it is read: the engine never comes to exist with the weights read from it.
    with pytest.raises(CheckpointError, match=r"model\.safetensors does not match its checksum"):
        run(hooks, "training.steps=2", f"checkpoint.load={ckpt}", f"output_dir={tmp_path}/resumed")
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()


def test_a_new_run_starts_from_a_checkpoints_weights_and_nothing_else(hooks, tmp_path):
    """``model.init_checkpoint``: the weights of another run's checkpoint, its shapes, its tokenizer; step 0,
    fresh Adam state and data position. ``checkpoint.load`` resumes instead."""
    from omegaconf import OmegaConf


    first = run(hooks, "training.steps=3", "model.layers=3", f"output_dir={tmp_path}/a")
    assert [r["step"] for r in first] == [1, 2, 3]
    # A shorter run than the source's step count: a start, not a resume, so there is something to do. The
    # shape (3 layers) comes from the checkpoint; the preset's tiny model has 2.
    cfg = load_config("tiny", [*MNLI, "training.steps=2", f"model.init_checkpoint={tmp_path / 'a'}",
                               f"output_dir={tmp_path}/b"], hooks.registrations.config_sections)
    assert cfg.model.layers == 3
    engine = build_engine(cfg, hooks)
    weights, _ = final_weights(tmp_path / "a")
    for unit, tensors in engine.model.weights().items():
        for name, t in tensors.items():
            assert torch.equal(t, weights[f"{unit}.{name}"]), (unit, name)
        for name, t in engine.store.entries[unit]["optim"].items():
            assert not t.any(), (unit, name)  # fresh optimizer state
        assert unit.role in ("embeddings", "decoder", "head")
    second = train(cfg, hooks, progress=False)
    assert [r["step"] for r in second] == [1, 2]
    assert read_meta(find_checkpoint(tmp_path / "b"))["step"] == 2
    saved = OmegaConf.load(find_checkpoint(tmp_path / "b") / "config.yaml")
    assert saved.model.init_checkpoint == str(tmp_path / "a")
    # Its own checkpoints resume as any run's do, without reaching for the source again.
    shutil.rmtree(tmp_path / "a")
    resumed = run(hooks, "model.layers=3", "training.steps=3", "checkpoint.load=latest", f"output_dir={tmp_path}/b")
    assert [r["step"] for r in resumed] == [3]


def test_start_and_resume_are_distinct_and_exclusive(hooks, tmp_path):
    from ipuft.errors import ConfigError

    run(hooks, "training.steps=1", f"output_dir={tmp_path}/a")
    with pytest.raises(ConfigError, match=r"starts a new run from a checkpoint's weights and checkpoint\.load resumes"):
        load_config("tiny", [*MNLI, f"model.init_checkpoint={tmp_path / 'a'}", f"checkpoint.load={tmp_path / 'a'}"],
                    hooks.registrations.config_sections)
    with pytest.raises(ConfigError, match=r"model.init_checkpoint .*: model.layers=5 but the checkpoint has 2"):
        load_config("tiny", [*MNLI, f"model.init_checkpoint={tmp_path / 'a'}", "model.layers=5"],
                    hooks.registrations.config_sections)
