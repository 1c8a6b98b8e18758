"""``execution.activation_offload=disk``: layer-boundary activations spilled to disk in the forward and read
back a row ahead in the backward train bit for bit as in memory, write exactly the bytes the plan declares,
and fail (a full disk, a vanished file) with one line that leaves the last checkpoint intact."""

import errno
import fcntl
import json
import os
import shutil
import threading

import dist_workers
import pytest
import torch
from distributed import spawn
from test_engine import batches, make_engine, max_rel
from test_faults import run_cli

from ipuft.cli.main import main
from ipuft.engine.spill import LOCK, SpillFiles, remove_stale
from ipuft.errors import ConfigError, SpillError
from ipuft.plan.estimate import estimate
from ipuft.plan.fit import format_plan

# GA=4 of 2 rows, 3 layers, clipping and a loss scale: a step whose every path the buffers serve.
COMMON = ("training.global_batch_size=8", "execution.micro_batch_size=2", "model.layers=3", "model.hidden_size=32",
          "model.attention.heads=2", "model.attention.rotary_dim=8",
          "training.optimizer.gradient_clipping=0.05", "training.optimizer.learning_rate.maximum=3e-3",
          "execution.loss_scaling=64")
PRECISIONS = {"float32": (), "bfloat16": ("model.precision=bfloat16", "training.stochastic_rounding=true")}


def trained(hooks, make_config, placement, *overrides, steps=2):
    """``steps`` steps of a fresh engine with ``activation_offload=placement``: results, weights, Adam state."""
    cfg = make_config(*COMMON, f"execution.activation_offload={placement}", *overrides)
    engine = make_engine(cfg, hooks)
    try:
        results = [engine.step(b, 1e-3) for b in batches(cfg)[:steps]]
        return cfg, engine, results, engine.model.weights(), engine.store.state("optim")
    finally:
        engine.close()


def assert_same_training(a, b):
    (_, _, ra, wa, oa), (_, _, rb, wb, ob) = a, b
    assert [(r.loss, r.grad_norm) for r in ra] == [(r.loss, r.grad_norm) for r in rb]
    for mine, theirs in ((wa, wb), (oa, ob)):
        assert mine.keys() == theirs.keys()
        for unit in mine:
            for name, t in mine[unit].items():
                assert torch.equal(t, theirs[unit][name]), (unit, name)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_disk_trains_bit_for_bit_as_host_and_device_memory(hooks, make_config, tmp_path, precision):
    extra = (*PRECISIONS[precision], f"execution.spill_dir={tmp_path / 'spill'}")
    disk = trained(hooks, make_config, "disk", *extra)
    cfg, engine, results = disk[:3]
    planned = estimate(cfg, engine.parts, hooks)
    entry = 2 * 8 * 32 * (4 if precision == "float32" else 2)
    assert planned["disk_bytes"] == 3 * 4 * entry  # every decoder layer's input, each micro-batch
    for r in results:
        assert r.spill_written_bytes == r.spill_read_bytes == planned["disk_bytes"]
        assert r.activation_bytes <= planned["activation_bytes"] == (2 * 4 + 1) * entry
    assert list((tmp_path / "spill").iterdir()) == []  # the rank's directory went with the engine
    for placement in (True, False):
        other = trained(hooks, make_config, placement, *PRECISIONS[precision])
        assert_same_training(disk, other)
        assert all(r.spill_written_bytes == 0 for r in other[2])
        if placement:  # the same host<->device traffic as activation offload to host memory
            assert [r.traffic for r in other[2]] == [r.traffic for r in results] == [planned["traffic"]] * 2


def test_the_plan_declares_disk_bytes_and_the_host_holds_two_rows(hooks, make_config):
    host, disk = (make_config(*COMMON, f"execution.activation_offload={p}") for p in ("host", "disk"))
    assert host.execution.activation_offload is True  # "host" names true
    engine = make_engine(host, hooks)
    on_host, on_disk = estimate(host, engine.parts, hooks), estimate(disk, engine.parts, hooks)
    entry = 2 * 8 * 32 * 4
    assert on_host["disk_bytes"] == 0 and on_disk["disk_bytes"] == 3 * 4 * entry
    assert on_host["host_bytes"] - on_disk["host_bytes"] == (4 * 4 - 9) * entry  # x[L+1][GA] -> 2·GA + 1
    assert "disk (rank):          0.023 MiB of activations written and read back a step" in format_plan(on_disk)
    assert "disk (rank)" not in format_plan(on_host)


def test_the_forward_writes_each_entry_once_and_the_reader_keeps_one_row_ahead(hooks, make_config, tmp_path,
                                                                                  monkeypatch):
    cfg = make_config(*COMMON, "execution.activation_offload=disk", f"execution.spill_dir={tmp_path}")
    engine = make_engine(cfg, hooks)
    opened, read, held = [], [], []
    real_open, real_read = os.open, SpillFiles._read_file

    def counting_open(path, flags, *args, **kwargs):
        if str(path).startswith(str(tmp_path)) and flags & os.O_EXCL and not str(path).endswith(LOCK):
            opened.append(os.path.basename(path))
        return real_open(path, flags, *args, **kwargs)

    def reading(self, key):
        read.append(key)
        held.append(self._held)
        return real_read(self, key)

    monkeypatch.setattr("ipuft.engine.spill.os.open", counting_open)
    monkeypatch.setattr(SpillFiles, "_read_file", reading)
    engine.step(batches(cfg)[0], 1e-3)
    engine.close()
    assert sorted(opened) == sorted(f"x-{row}-{mb}" for row in range(3) for mb in range(4))
    assert read == [("x", row, mb) for row in (2, 1, 0) for mb in range(4)]  # the backward's order
    assert max(held) <= 4  # at most a row (GA entries) read and not yet done with


def test_stale_spills_lose_only_their_own_files(tmp_path):
    stale, foreign, live = tmp_path / "ipuft-spill-0-a", tmp_path / "ipuft-spill-1-b", tmp_path / "ipuft-spill-2-c"
    for d in (stale, foreign, live):
        d.mkdir()
        (d / LOCK).touch()
        (d / "x-1-0").write_bytes(b"old")
    (foreign / "notes.txt").write_text("keep me")
    (tmp_path / "x-3-3").write_bytes(b"not in a spill directory")
    (tmp_path / "ipuft-spill-9-z").symlink_to(foreign)  # links are not followed
    fd = os.open(live / LOCK, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live run's
    try:
        assert remove_stale(tmp_path) == 2
    finally:
        os.close(fd)
    assert not stale.exists()
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in live.iterdir()) == [LOCK, "x-1-0"]
    assert (tmp_path / "x-3-3").exists()


def test_bad_values_and_a_spill_dir_that_is_a_file_are_one_line(make_config, hooks, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"^execution.activation_offload: must be false \(on the device\), true"):
        make_config("execution.activation_offload=tape")
    with pytest.raises(ConfigError, match=r"^execution.spill_dir: is where activation_offload=disk spills"):
        make_config("execution.spill_dir=/tmp")
    (tmp_path / "file").write_text("")
    code, err = run_cli(["train", "--config", "tiny", "execution.activation_offload=disk", f"output_dir={tmp_path}/r",
                         f"execution.spill_dir={tmp_path / 'file'}"], capsys)
    assert (code, err) == (2, f"ipuft: error: execution.spill_dir: {tmp_path / 'file'} exists and is not a directory\n")
    assert not (tmp_path / "r").exists()


def test_a_disk_without_room_for_a_step_is_refused_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("ipuft.run.rundir.shutil.disk_usage",
                        lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    code, err = run_cli(["train", "--config", "tiny", "execution.activation_offload=disk", "checkpoint.save=null",
                         f"output_dir={tmp_path}/r", f"execution.spill_dir={tmp_path}/s"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"ipuft: error: execution.spill_dir: {tmp_path}/s has 0.001 MiB free, but a step spills")


def test_the_engine_checks_free_space_when_it_opens_its_spill(hooks, make_config, tmp_path, monkeypatch):
    cfg = make_config(*COMMON, "execution.activation_offload=disk", f"execution.spill_dir={tmp_path}")
    monkeypatch.setattr("ipuft.engine.spill.shutil.disk_usage", lambda path: shutil._ntuple_diskusage(10, 9, 1))
    engine = make_engine(cfg, hooks)
    with pytest.raises(SpillError, match=r"has 0.000 MiB free, but a step spills 0.023 MiB of activations there"):
        engine.step(batches(cfg)[0], 1e-3)
    assert list(tmp_path.iterdir()) == []


def _train_with_checkpoints(tmp_path, capsys, steps=3):
    out = tmp_path / "run"
    args = ["train", "--config", "tiny", "execution.activation_offload=disk", "training.global_batch_size=4",
            f"training.steps={steps}", "checkpoint.steps=1", f"output_dir={out}"]
    return out, args, run_cli(args, capsys)


def _assert_failed_cleanly(out, args, code, err, capsys):
    from ipuft.io.checkpoint import checkpoints, verify

    line = err.strip().splitlines()[-1]  # after the progress bar
    assert code == 2 and "Traceback" not in err and err.count("ipuft: error") == 1, err
    assert line.startswith(f"ipuft: error: execution.spill_dir: {out / 'spill'}") or \
        f"file {out / 'spill'}/ipuft-spill-0-" in line, err
    saved = checkpoints(out / "checkpoints")
    assert [p.name for p in saved] == ["step-00000001", "step-00000002"]
    for checkpoint in saved:
        verify(checkpoint)
    assert list((out / "spill").iterdir()) == []  # the failed run's files are gone
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    # The last checkpoint resumes and the run finishes.
    main([*args[:-1], f"output_dir={out}", "checkpoint.load=latest"])
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3


def test_a_full_disk_is_one_line_and_the_last_checkpoint_stays(tmp_path, monkeypatch, capsys):
    write, calls = os.write, []
    per_step = 2 * 4  # 2 layers × GA 4

    def full_after_two_steps(fd, data):
        if threading.current_thread().name == "ipuft-spill-writer":
            calls.append(fd)
            if len(calls) > 2 * per_step + 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    monkeypatch.setattr("ipuft.engine.spill.os.write", full_after_two_steps)
    out, args, (code, err) = _train_with_checkpoints(tmp_path, capsys)
    assert err.endswith("ran out of space writing spilled activations (0.016 MiB a step); free space there or set "
                        "execution.spill_dir to a larger disk\n"), err
    monkeypatch.setattr("ipuft.engine.spill.os.write", write)
    _assert_failed_cleanly(out, args, code, err, capsys)


def test_a_vanished_spill_file_is_one_line_and_the_last_checkpoint_stays(tmp_path, monkeypatch, capsys):
    schedule, steps = SpillFiles.schedule, []

    def delete_one_at_step_three(self, keys):
        steps.append(keys)
        if len(steps) == 3:
            self._writes.join()
            os.unlink(self.dir / "x-0-1")  # between the forward that wrote it and the backward that reads it
        schedule(self, keys)

    monkeypatch.setattr(SpillFiles, "schedule", delete_one_at_step_three)
    out, args, (code, err) = _train_with_checkpoints(tmp_path, capsys)
    assert "x-0-1 vanished before the backward read it; keep" in err, err
    monkeypatch.setattr(SpillFiles, "schedule", schedule)
    _assert_failed_cleanly(out, args, code, err, capsys)


def test_metrics_record_the_bytes_spilled_each_step(tmp_path, hooks):
    out = tmp_path / "run"
    main(["train", "--config", "tiny", "execution.activation_offload=disk", "training.global_batch_size=4",
          "training.steps=2", "checkpoint.save=null", f"output_dir={out}"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["spill_written_bytes"], r["spill_read_bytes"]) for r in records] == [(2 * 4 * 8 * 64 * 4,) * 2] * 2


@pytest.mark.parametrize(("dp", "tp"), [(2, 1), (1, 2)], ids=["dp2", "tp2"])
def test_parallel_ranks_spill_their_own_slices_bit_for_bit(hooks, tmp_path, dp, tp):
    from test_distributed import COMMON as LAYOUT
    from test_distributed import rel

    from ipuft.config import load_config
    from ipuft.data.tokens import data_source
    from ipuft.run.runtime import build_engine
    from ipuft.run.schedule import learning_rate
    from ipuft.run.train import replica_batch

    steps = 2
    base = [*LAYOUT, f"training.steps={steps}", f"training.global_batch_size={2 * dp}"]
    layout = [*base, f"execution.data_parallel={dp}", f"execution.tensor_parallel={tp}"]
    configs = {"host": [*layout, "execution.activation_offload=true"],
               "disk": [*layout, "execution.activation_offload=disk", f"execution.spill_dir={tmp_path / 'spill'}"]}
    spawn(dp * tp, dist_workers.train_configs, configs, steps, str(tmp_path), tmp=tmp_path)
    cfg = load_config("tiny", [*base, "execution.activation_offload=disk", f"execution.spill_dir={tmp_path / 'one'}"],
                      hooks.registrations.config_sections)
    engine, data = build_engine(cfg, hooks), data_source(cfg)
    losses = [engine.step(replica_batch(cfg, data, s, engine.layout),
                          learning_rate(s, steps, cfg.training.optimizer.learning_rate)).loss for s in range(steps)]
    weights = engine.model.full_weights()
    engine.close()
    for rank in range(dp * tp):
        host, disk = (torch.load(tmp_path / f"{name}.rank{rank}.pt") for name in ("host", "disk"))
        assert (disk["losses"], disk["norms"]) == (host["losses"], host["norms"])
        # each rank writes its own files: the TP slice of every decoder layer's input, GA=2 micro-batches
        assert disk["spill_written"] == disk["planned_disk"] == 2 * 2 * 8 * 64 * 4 // tp
        assert disk["spill_dir"].startswith(f"ipuft-spill-{rank}-") and host["spill_written"] == 0
    host, disk = (torch.load(tmp_path / f"{name}.rank0.pt") for name in ("host", "disk"))
    for unit, w in weights.items():
        for n, t in w.items():
            assert torch.equal(disk["weights"][unit][n], host["weights"][unit][n]), (unit, n)
            assert max_rel(disk["weights"][unit][n], t) <= 1e-5, (unit, n)
    assert all(rel(a, b) <= 1e-5 for a, b in zip(disk["losses"], losses, strict=True))
    assert list((tmp_path / "spill").iterdir()) == []


def test_fit_advice_considers_spilling_to_disk(hooks, make_config):
    from ipuft.plan.fit import fit, needs

    host, disk = (make_config(*COMMON, "execution.device=cpu", f"execution.activation_offload={p}")
                  for p in ("true", "disk"))
    engine = make_engine(host, hooks)
    planned = {p: estimate(c, engine.parts, hooks) for p, c in (("host", host), ("disk", disk))}
    memory = {"host_available_bytes": 0, "device_free_bytes": None, "process_bytes": 0, "disk_free_bytes": 10**12}
    needed = {p: needs(host, planned[p], memory)[0] for p in planned}
    memory["host_available_bytes"] = (needed["host"] + needed["disk"]) // 2  # only the spill fits
    advice = fit(host, hooks, planned["host"], memory)
    assert not advice["fits"] and "execution.activation_offload=disk" in advice["would_fit_with"]
    memory["disk_free_bytes"] = planned["disk"]["disk_bytes"] - 1  # nor does it, without room on the disk
    assert "execution.activation_offload=disk" not in fit(host, hooks, planned["host"], memory)["would_fit_with"]


def test_saved_configs_keep_their_placement_and_lose_their_spill_dir(make_config):
    from ipuft.config.migrate import migrate

    for saved in (True, False, "disk"):
        data = {"execution": {"activation_offload": saved, "spill_dir": "/elsewhere"}}
        migrate(data, None)
        assert data == {"execution": {"activation_offload": saved}}  # where the reading run spills is its own
        assert make_config(f"execution.activation_offload={str(saved).lower()}").execution.activation_offload == saved
