"""Checkpoint I/O: saves stream within about a unit of memory, the files are plain safetensors, and checksums are
verified as files are read, for the files a command reads and no others."""

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import dist_workers
import pytest
import torch
from cli_helpers import run_cli as cli
from distributed import spawn
from safetensors import safe_open
from safetensors.torch import load_file
from test_bad_input import _checkpoint, _flip, _truncate

from ipuft.components import VariableSpec
from ipuft.config import load_config
from ipuft.data.tokens import data_source
from ipuft.errors import CheckpointError
from ipuft.io.checkpoint import OPTIM, WEIGHTS, open_tensors, read_manifest, verify
from ipuft.io.safetensors import SafetensorsReader, SafetensorsWriter
from ipuft.run.resume import save
from ipuft.run.runtime import build_engine
from ipuft.run.train import replica_batch

TESTS = Path(__file__).parent

RECIPES = {
    "float32": [],
    "bf16-sr": ["model.precision=bfloat16", "training.stochastic_rounding=true"],
    "fp16-master": ["model.precision=float16", "training.master_weights=true"],
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_files_load_with_safetensors_and_equal_the_gathered_tensors(hooks, tmp_path, recipe):
    cfg = load_config("tiny", ["training.global_batch_size=2", *RECIPES[recipe]], hooks.registrations.config_sections)
    engine = build_engine(cfg, hooks)
    engine.step(replica_batch(cfg, data_source(cfg), 0, engine.layout), 1e-3)  # optimizer state is not zero
    checkpoint = save(engine, cfg, tmp_path / "checkpoints", 1)
    dtype = {"float32": torch.float32, "bf16-sr": torch.bfloat16, "fp16-master": torch.float16}[recipe]
    for file, group in ((WEIGHTS, "fwd"), (OPTIM, "optim")):
        expected = {f"{unit}.{n}": t for unit, w in engine.model.full_weights(group).items() for n, t in w.items()}
        with safe_open(str(checkpoint / file), framework="pt") as f:
            assert f.metadata() == {"format": "ipuft-checkpoint"}
            assert set(f.keys()) == set(expected)
            for name, tensor in expected.items():
                got = f.get_tensor(name)
                assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        assert {t.dtype for t in expected.values()} == ({dtype} if group == "fwd" else {torch.float32})
        # Units in program order, each in its specs' order: the order the engine reads them back in.
        reader = open_tensors(checkpoint, file)
        assert sorted(reader.keys(), key=lambda n: reader.entries[n].begin) == list(expected)
        reader.close()
        # The manifest's digest, computed while writing, is that of the bytes on disk.
        assert read_manifest(checkpoint)[file] == hashlib.sha256((checkpoint / file).read_bytes()).hexdigest()
    assert any(k.endswith(".master") for k in load_file(str(checkpoint / OPTIM))) == (recipe == "fp16-master")
    verify(checkpoint)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(33, 7, generator=g), "half": torch.randn(5, 3, generator=g).bfloat16(),
            "ids": torch.arange(12, dtype=torch.int64).view(3, 4), "empty": torch.zeros(0, 4),
            "scalar": torch.tensor(2.5, dtype=torch.float16), "bytes": torch.randint(0, 255, (9000,), dtype=torch.uint8,
                                                                                        generator=g),
            "flag": torch.tensor([True, False])}


def _write(path, tensors):
    specs = [VariableSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    with SafetensorsWriter(path, specs, {"format": "test"}) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
        return writer.close()


@pytest.mark.parametrize("order", ["forward", "backward", "shuffled", "some", "none"])
def test_the_reader_hashes_every_byte_once_in_any_order(tmp_path, order):
    tensors = _tensors()
    path = tmp_path / "t.safetensors"
    digest = _write(path, tensors)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert {k: v for k, v in load_file(str(path)).items()}.keys() == tensors.keys()
    names = {"forward": list(tensors), "backward": list(tensors)[::-1], "some": ["half", "bytes"], "none": [],
             "shuffled": ["bytes", "w", "flag", "ids", "half", "scalar", "empty"]}[order]
    reader = SafetensorsReader(path, "t.safetensors", digest)
    for name in [*names, *names[:2]]:  # the first two again, behind the cursor
        got = reader.get(name)
        assert got.dtype == tensors[name].dtype and torch.equal(got, tensors[name]), name
    reader.finish()
    assert reader.hashed == path.stat().st_size  # each byte once, whatever was read and in whatever order
    assert torch.equal(reader.get("w"), tensors["w"])  # still readable after the check
    home = torch.empty(33, 7)
    assert reader.get("w", out=home) is home and torch.equal(home, tensors["w"])  # read in place
    with pytest.raises(ValueError, match="cannot read it into"):
        reader.get("w", out=torch.empty(7, 33))


@pytest.mark.parametrize("order", ["forward", "none"])
def test_a_byte_changed_anywhere_fails_the_final_check(tmp_path, order):
    tensors = _tensors()
    path = tmp_path / "t.safetensors"
    digest = _write(path, tensors)
    data = bytearray(path.read_bytes())
    data[-100] ^= 1  # inside "bytes", the largest tensor; the header stays valid
    path.write_bytes(bytes(data))
    reader = SafetensorsReader(path, "checkpoint c: t.safetensors", digest)
    for name in tensors if order == "forward" else []:
        reader.get(name)
    with pytest.raises(CheckpointError, match=r"^checkpoint c: t\.safetensors does not match its checksum "
                                              r"\(corrupted\)$"):
        reader.finish()
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        reader.finish()  # and again: a failed check never turns into a pass
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        reader.get("w")


def _raw_file(path, header, data=b"", length=None):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
HEADERS = {
    "short": (lambda p: p.write_bytes(b"\x01\x02"), "too short for a safetensors header: truncated"),
    "huge-length": (lambda p: _raw_file(p, GOOD, bytes(8), length=1 << 40), "exceeds 100000000 bytes"),
    "length-past-end": (lambda p: _raw_file(p, GOOD, length=5000), "its header needs 5008 bytes, the file holds"),
    "not-json": (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"{no}"), "its header is not JSON"),
    "not-object": (lambda p: _raw_file(p, [1, 2]), "its header is not a JSON object"),
    "unknown-dtype": (lambda p: _raw_file(p, {"a": {**GOOD["a"], "dtype": "F99"}}, bytes(8)), "unknown dtype 'F99'"),
    "bad-shape": (lambda p: _raw_file(p, {"a": {**GOOD["a"], "shape": [-2]}}, bytes(8)), "shape is not a list"),
    "shape-vs-bytes": (lambda p: _raw_file(p, {"a": {**GOOD["a"], "shape": [3]}}, bytes(8)), "is not its 8 bytes"),
    "gap": (lambda p: _raw_file(p, {"a": {**GOOD["a"], "data_offsets": [4, 12]}}, bytes(12)),
            "do not follow those before it"),
    "overlap": (lambda p: _raw_file(p, {**GOOD, "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}},
                                    bytes(8)), "do not follow those before it"),
    "data-truncated": (lambda p: _raw_file(p, GOOD, bytes(5)), "its tensors end at byte"),
    "trailing-bytes": (lambda p: _raw_file(p, GOOD, bytes(16)), "its tensors end at byte"),
    "metadata": (lambda p: _raw_file(p, {"__metadata__": {"a": 1}, **GOOD}, bytes(8)), "__metadata__"),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_a_bad_header_is_one_line(tmp_path, case):
    make, fragment = HEADERS[case]
    path = tmp_path / "x.safetensors"
    make(path)
    with pytest.raises(CheckpointError) as info:
        SafetensorsReader(path, "checkpoint c: x.safetensors")
    message = str(info.value)
    assert message.startswith("checkpoint c: x.safetensors is damaged (") and "\n" not in message
    assert fragment in message, message


def test_export_reads_only_the_weights_and_resume_refuses_damaged_optimizer_state(tmp_path, trained, capsys,
                                                                                   monkeypatch, hooks):
    """optim.safetensors damaged: export (and a new run from the weights) go on, with the right weights;
    resuming, which reads it, stops with one line naming it."""
    from ipuft.engine.model import build_model
    from ipuft.io.hf_names import unit_mappings

    monkeypatch.chdir(tmp_path)
    checkpoint = _checkpoint(tmp_path, trained)
    _flip(checkpoint / OPTIM)
    code, _, err = cli(capsys, "export", "--checkpoint", str(checkpoint), "--hf", str(tmp_path / "out"))
    assert code == 0, err
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    saved = load_file(str(checkpoint / WEIGHTS))
    cfg = load_config(str(checkpoint / "config.yaml"), [], hooks.registrations.config_sections)
    mappings = unit_mappings(build_model(cfg, hooks).modules, cfg.model.layers)
    pairs = [(hf, f"{unit}.{local}") for unit, m in mappings.items() for local, hf in m.items()]
    assert set(exported) == {hf for hf, _ in pairs} and len(pairs) == len(saved)
    for hf, ours in pairs:
        assert torch.equal(exported[hf], saved[ours]), hf
    code, _, err = cli(capsys, "train", "--config", "tiny", "training.global_batch_size=2", "training.steps=2",
                            f"model.init_checkpoint={checkpoint}", f"output_dir={tmp_path}/fresh")
    assert code == 0, err
    code, _, err = cli(capsys, "train", "--config", "tiny", "training.global_batch_size=2", "training.steps=2",
                            f"checkpoint.load={checkpoint}", f"output_dir={tmp_path}/resumed")
    assert code == 2
    assert err == f"ipuft: error: checkpoint {checkpoint}: optim.safetensors does not match its checksum (corrupted)\n"
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()  # it stopped before any step


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_weights_stop_export_train_and_eval_with_one_line(tmp_path, trained, capsys, monkeypatch, damage):
    monkeypatch.chdir(tmp_path)
    checkpoint = _checkpoint(tmp_path, trained)
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text("".join(json.dumps({"input_ids": list(range(i, i + 8))}) + "\n" for i in range(4)))
    if damage == "flip":
        _flip(checkpoint / WEIGHTS)
        expected = f"ipuft: error: checkpoint {checkpoint}: model.safetensors does not match its checksum (corrupted)\n"
    else:
        _truncate(checkpoint / WEIGHTS, (checkpoint / WEIGHTS).stat().st_size - 100)
        expected = f"ipuft: error: checkpoint {checkpoint}: model.safetensors is damaged (its tensors end at byte "
    commands = {
        "export": ["export", "--checkpoint", str(checkpoint), "--hf", str(tmp_path / "out")],
        "resume": ["train", "--config", "tiny", "training.global_batch_size=2", "training.steps=2",
                   f"checkpoint.load={checkpoint}", f"output_dir={tmp_path}/resumed"],
        "start": ["train", "--config", "tiny", "training.global_batch_size=2", "training.steps=2",
                  f"model.init_checkpoint={checkpoint}", f"output_dir={tmp_path}/fresh"],
        "eval": ["eval", "--checkpoint", str(checkpoint), "data.format=tokens", f"data.path={tokens}"],
    }
    for what, argv in commands.items():
        code, _, err = cli(capsys, *argv)
        assert code == 2, (what, err)
        assert err.startswith(expected) and err.count("\n") == 1 and "Traceback" not in err, (what, err)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists() and not (tmp_path / "fresh" / "metrics.jsonl").exists()


def test_damaged_small_files_are_refused_when_read(tmp_path, trained, capsys, monkeypatch):
    """meta.json and state.safetensors are checked against the manifest as they are read."""
    monkeypatch.chdir(tmp_path)
    for name in ("meta.json", "state.safetensors"):
        (tmp_path / name).mkdir()
        checkpoint = _checkpoint(tmp_path / name, trained)
        data = bytearray((checkpoint / name).read_bytes())
        data[-3] ^= 0x01  # checked before it is parsed
        (checkpoint / name).write_bytes(bytes(data))
        code, _, err = cli(capsys, "train", "--config", "tiny", "training.global_batch_size=2", "training.steps=2",
                                f"checkpoint.load={checkpoint}", f"output_dir={tmp_path / name}/resumed")
        assert code == 2
        assert err == f"ipuft: error: checkpoint {checkpoint}: {name} does not match its checksum (corrupted)\n"


# -- memory -----------------------------------------------------------------------------------------------

# A decoder unit of 512 × 2048 is 3.1 M float32 variables: 12.6 MB of weights, 37.8 MB with Adam's state. The
# model's checkpoint is about 310 MB, so a save that copies it whole is far past two units' bytes.
BIG = ["model.layers=8", "model.hidden_size=512", "model.intermediate_size=2048", "model.attention.heads=8",
       "model.embedding.vocab_size=256", "training.global_batch_size=2"]


def _memory_env():
    # A fixed mmap threshold: freed tensors go back to the system at once, so the peak resident set is the
    # peak of live memory and not of what malloc's dynamic threshold happened to keep.
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}


def test_a_save_adds_at_most_two_units_of_host_memory(tmp_path):
    code = f"import dist_workers; dist_workers.save_memory(0, {BIG!r}, {str(tmp_path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=TESTS, env=_memory_env(), capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "memory.rank0.json").read_text())
    print(f"save added {got['extra'] / 1e6:.1f} MB; two units are {2 * got['unit_bytes'] / 1e6:.1f} MB, the "
          f"checkpoint {got['checkpoint_bytes'] / 1e6:.1f} MB")
    assert got["checkpoint_bytes"] > 8 * got["unit_bytes"]  # the bound is far below a whole copy
    assert got["extra"] <= 2 * got["unit_bytes"], got


def test_a_save_at_dp2_tp2_adds_at_most_two_units_on_every_rank(tmp_path, monkeypatch):
    for key, value in _memory_env().items():
        monkeypatch.setenv(key, value)  # inherited by the spawned ranks
    # Smaller, for four ranks on two cores: a unit of 256 × 1024 is 9.4 MB with Adam's state, the checkpoint 79 MB.
    overrides = ["model.layers=8", "model.hidden_size=256", "model.intermediate_size=1024",
                 "model.attention.heads=8", "model.embedding.vocab_size=256", "training.global_batch_size=4",
                 "execution.data_parallel=2", "execution.tensor_parallel=2", "execution.rts=true"]
    spawn(4, dist_workers.save_memory, overrides, str(tmp_path), tmp=tmp_path)
    for rank in range(4):
        got = json.loads((tmp_path / f"memory.rank{rank}.json").read_text())
        print(f"rank {rank}: save added {got['extra'] / 1e6:.1f} MB; two units are {2 * got['unit_bytes'] / 1e6:.1f} "
              f"MB, the checkpoint {got['checkpoint_bytes'] / 1e6:.1f} MB, the rank's store {got['store_bytes'] / 1e6:.1f} MB")
        assert got["extra"] <= 2 * got["unit_bytes"], (rank, got)
    verify(next((tmp_path / "checkpoints").glob("step-*")))
