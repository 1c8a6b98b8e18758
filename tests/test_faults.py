"""Faults around a run: a full disk, a killed writer's torn metrics, two runs into one directory, a Ctrl-C
while the command starts, and a seeded fuzz over config overrides, checkpoint metadata and data rows."""

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_bad_input import MNLI, SAMPLE, _checkpoint, _reseal, snapshot

from ipuft.cli.main import main


def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    _, err = capsys.readouterr()
    return info.value.code, err


def test_a_disk_without_room_for_a_checkpoint_is_refused_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("ipuft.run.rundir.shutil.disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    code, err = run_cli(["train", "--config", "tiny", f"output_dir={tmp_path}/run"], capsys)
    assert code == 2
    assert err.startswith("ipuft: error: checkpoint.save: ") and "free, but one checkpoint of this model takes" in err
    assert err.count("\n") == 1
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_an_export_that_fails_midway_leaves_nothing_behind(tmp_path, trained, monkeypatch, capsys):
    from ipuft.io.safetensors import SafetensorsWriter

    monkeypatch.chdir(tmp_path)
    checkpoint = _checkpoint(tmp_path, trained)
    written = []
    write = SafetensorsWriter.write

    def full_disk(self, name, tensor):
        written.append(name)
        if len(written) > 3:  # a few tensors in, the disk fills
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, name, tensor)

    monkeypatch.setattr(SafetensorsWriter, "write", full_disk)
    before = snapshot(tmp_path)
    code, err = run_cli(["export", "--checkpoint", str(checkpoint), "--hf", str(tmp_path / "out")], capsys)
    assert code == 2 and written
    assert err == f"ipuft: error: --hf {tmp_path / 'out'} cannot be written (No space left on device); nothing was left behind\n"
    assert snapshot(tmp_path) == before


def test_torn_and_garbage_metrics_lines_are_dropped_before_a_resume_rewrites_them(tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--config", "tiny", "training.global_batch_size=2", f"output_dir={out}"]
    main(["train", *common, "training.steps=2"])
    metrics = out / "metrics.jsonl"
    good = metrics.read_text().splitlines()
    metrics.write_bytes(("\n".join([good[0], "[1, 2]", '{"step": "two"}', "\udcff".encode("utf-8", "surrogatepass").decode(
        "utf-8", "replace"), good[1], '{"step": 2, "loss": 1.0', "null"]) + "\n").encode() + b"\xff\xfe\n")
    main(["train", *common, "training.steps=3", "checkpoint.load=latest"])
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def test_two_runs_into_one_directory_one_proceeds_the_other_is_refused(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "ipuft.cli.main", "train", "--config", "tiny", "training.global_batch_size=2",
            "training.steps=40", "checkpoint.steps=10", f"output_dir={out}"]
    procs = [subprocess.Popen(args, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=240), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert refused.count("\n") == 1 and "Traceback" not in refused
    assert "is in use by another ipuft run" in refused or "already holds a run" in refused
    # The run that proceeded is intact: every step once, in order, and its checkpoints verify.
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 41))
    from ipuft.io.checkpoint import checkpoints, verify

    found = checkpoints(out / "checkpoints")
    assert [p.name for p in found] == ["step-00000010", "step-00000020", "step-00000030", "step-00000040"]
    for checkpoint in found:
        verify(checkpoint)


# Through the hooks' and torch's imports (about 0.2 and 1 s here), the build, training and the teardown: a
# SIGINT inside torch's import once left it half-imported (a RecursionError reported as a plugin's failure),
# or made the interpreter kill itself by the signal after printing its line (exit -2).
@pytest.mark.parametrize("delay", [0.3, 0.6, 0.9, 1.2, 1.5, 2.5])
def test_ctrl_c_while_the_command_starts_is_one_line(tmp_path, delay):
    proc = subprocess.Popen([sys.executable, "-m", "ipuft.cli.main", "train", "--config", "tiny",
                             f"output_dir={tmp_path}/run"], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:  # it finished first: nothing to interrupt on this machine
        pytest.skip("the run finished before the signal")
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("ipuft: error: ")


# -- fuzz ---------------------------------------------------------------------------------------------------

KEYS = ["model.layers", "model.hidden_size", "model.attention.heads", "model.attention.rotary_dim",
        "model.sequence_length", "model.embedding.vocab_size", "model.layer_norm_epsilon", "model.precision",
        "model.dropout_prob", "training.steps", "training.global_batch_size", "training.stochastic_rounding",
        "training.optimizer.learning_rate.maximum", "plugins.adamw.eps", "plugins.adamw.beta1",
        "execution.micro_batch_size", "execution.loss_scaling", "execution.data_parallel", "checkpoint.to_keep",
        "data.format", "data.template", "data.packing", "output_dir", "no.such.key", "model"]
VALUES = ["0", "-1", "1", "2", "3", "inf", "-inf", "nan", ".nan", "1e30", "10000000000000000000000", "true", "null",
          "''", "'x'", "[1, 2]", "{a: 1}", "bfloat16", "float16", "dynamic", "${oc.env:HOME}", "0.5", "1e-12",
          "{premise} ${x}", "\u00e9\u4e2d", "&a [1]", "*a", "/proc/x", "'{missing}'"]
META = {"step": [-5, 1e30, "1", None, [1], 2**60, True], "updates": [-1, 10**9, "x"], "optim_state": ["yes", 1, None],
        "units": [None, [1], "decoder"], "loss_scale": [{"scale": -1}, {"scale": "x"}, None, []], "data": [[], {"rows": -1}],
        "format": ["other", None]}
ROWS = [{"premise": {"a": 1}}, {"premise": ["x"]}, {"label": 1.0}, {"label": "9"}, {"hypothesis": None}, [1, 2], "text",
        {"premise": "\u00e9" * 50}, {}, 17]


def _fuzz_case(rng, tmp, trained):
    """One mutated command line: overrides, a checkpoint with mutated metadata, or a file of mutated rows."""
    kind = rng.choice(["config", "meta", "rows"])
    base = ["train", "--config", "tiny", "training.steps=2", "training.global_batch_size=2", f"output_dir={tmp}/run"]
    if kind == "config":
        return base + [f"{rng.choice(KEYS)}={rng.choice(VALUES)}" for _ in range(rng.randint(1, 3))]
    if kind == "meta":
        checkpoint = _checkpoint(tmp, trained)
        meta = json.loads((checkpoint / "meta.json").read_text())
        field = rng.choice(list(META))
        meta[field] = rng.choice(META[field])
        (checkpoint / "meta.json").write_text(json.dumps(meta))
        _reseal(checkpoint)
        return [*base[:4], "training.steps=3", *base[5:], f"checkpoint.load={checkpoint}"]
    rows = [MNLI] * 3 + [{**MNLI, **row} if isinstance(row, dict) else row for row in rng.sample(ROWS, 2)]
    rng.shuffle(rows)
    path = tmp / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [*base, *SAMPLE, f"data.path={path}"]


@pytest.mark.parametrize("seed", range(4))
def test_fuzzed_inputs_never_end_in_a_traceback_or_in_silence(tmp_path_factory, trained, capsys, monkeypatch, seed):
    """50 seeded mutations per seed, 200 in all: each either trains its steps (exit 0 with metrics for them)
    or stops with one line and a non-zero exit; never a traceback."""
    rng = random.Random(seed)
    for case in range(50):
        tmp = tmp_path_factory.mktemp(f"fuzz{seed}-{case}")
        monkeypatch.chdir(tmp)
        argv = _fuzz_case(rng, tmp, trained)
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code
        _, err = capsys.readouterr()
        assert "Traceback" not in err, (argv, err)
        if code in (0, None):
            metrics = tmp / "run" / "metrics.jsonl"
            assert metrics.exists() and metrics.read_text().strip(), (argv, "exit 0 with nothing done")
        else:
            lines = [line for line in err.splitlines() if line.startswith("ipuft: error: ")]
            assert len(lines) == 1, (argv, err)


def test_a_run_killed_before_its_first_checkpoint_starts_again_without_hand_cleaning(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".ipuft.lock").touch()  # what a run killed during its first steps leaves
    (out / "config.yaml").write_text("model: {}\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "lo')
    main(["train", "--config", "tiny", "training.global_batch_size=2", "training.steps=2", f"output_dir={out}"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[0]["loss"] != 9.0
    # A finished run is another matter, with or without checkpoints.
    for extra in ([], ["checkpoint.save=null"]):
        done = tmp_path / f"done{len(extra)}"
        main(["train", "--config", "tiny", "training.global_batch_size=2", "training.steps=1", f"output_dir={done}",
              *extra])
        code, err = run_cli(["train", "--config", "tiny", "training.global_batch_size=2", "training.steps=1",
                             f"output_dir={done}", *extra], capsys)
        assert code == 2 and "already holds a run" in err


def test_resuming_an_older_checkpoint_makes_its_own_saves_the_latest(tmp_path, capsys):
    from ipuft.io.checkpoint import checkpoints, find_checkpoint, read_meta

    out = tmp_path / "run"
    common = ["--config", "tiny", "training.global_batch_size=2", "checkpoint.steps=2", "checkpoint.to_keep=2",
              f"output_dir={out}"]
    main(["train", *common, "training.steps=6"])
    assert [p.name for p in checkpoints(out / "checkpoints")] == ["step-00000004", "step-00000006"]
    old_six = (out / "checkpoints" / "step-00000006" / "model.safetensors").read_bytes()
    main(["train", *common, "training.steps=5", f"checkpoint.load={out / 'checkpoints' / 'step-00000004'}"])
    # step 5 is the newest save: the abandoned step 6 is gone, and to_keep kept what this run wrote last.
    assert [p.name for p in checkpoints(out / "checkpoints")] == ["step-00000004", "step-00000005"]
    assert read_meta(find_checkpoint(out))["step"] == 5
    main(["train", *common, "training.steps=6", "checkpoint.load=latest"])
    assert (out / "checkpoints" / "step-00000006" / "model.safetensors").read_bytes() == old_six  # exact resume
