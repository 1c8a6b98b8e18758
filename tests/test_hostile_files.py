"""Hostile files: a path that names a device, a FIFO or a directory where a file is read; a weight index that
does not match its weights; weights of more layers than config.json names; a kernels.json of impossible rates; a
``--trace`` that cannot be written; a config.json value of the wrong type. Each is one line naming what is wrong,
exit 2, no traceback, nothing written or changed (and nothing blocks: a FIFO is never waited on)."""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli, without_recipe
from test_bad_input import _checkpoint, snapshot

import ipuft.kernels as kernels
from ipuft.errors import CheckpointError, ConfigError, DataError, shown
from ipuft.families import HFConfigError, config_flag, config_float, config_int
from ipuft.io.files import read_bounded, read_json, require_regular

REVISION = "0123456789abcdef0123456789abcdef01234567"


class Blocked(BaseException):
    """Raised where a read blocks: no handler of the code under test (OSError, Exception) takes it for its own."""


@pytest.fixture(autouse=True)
def _never_blocks():
    """A reader that waits on a FIFO fails the test instead of hanging the suite."""
    def stuck(signum, frame):
        raise Blocked("a read blocked")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def _to_zero(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to("/dev/zero")
    return path


def _hf_copy(tmp: Path, trained: Path, name: str = "hf-copy") -> Path:
    hf = tmp / name
    shutil.copytree(trained / "hf", hf)
    return hf


def _tensor_names(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())


def _shard_is_fifo(tmp, trained):
    """An index naming a shard that is a FIFO."""
    hf = _hf_copy(tmp, trained)
    names = _tensor_names(hf / "model.safetensors")
    (hf / "model.safetensors").unlink()
    _fifo(hf / "model-00001-of-00001.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}))
    return hf


def _index_misplaces(tmp, trained):
    """An index that puts one tensor in a shard that holds another."""
    from safetensors.torch import save_file

    hf = _hf_copy(tmp, trained)
    names = _tensor_names(hf / "model.safetensors")
    (hf / "model.safetensors").rename(hf / "model-00001-of-00002.safetensors")
    save_file({"unrelated": torch.zeros(2)}, str(hf / "model-00002-of-00002.safetensors"))
    weight_map = dict.fromkeys(names, "model-00001-of-00002.safetensors")
    weight_map[names[0]] = "model-00002-of-00002.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return hf


def _fewer_layers(tmp, trained):
    """GPT-J weights of 2 layers under a config.json of 1."""
    hf = _hf_copy(tmp, trained)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "n_layer": 1}))
    return hf


def _llama_extra_layers(tmp, trained):
    """Llama weights of 6 layers (model.layers.5.* the last) under a config.json of 2."""
    from llama_reference import save_hf

    _, hf = save_hf(tmp / "llama6", "llama", num_hidden_layers=6)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    return hf


def _hub_ref(tmp, target):
    """A hub cache holding org/tiny, whose refs/main is made by ``target``; HF_HUB_CACHE must point at tmp/hub."""
    repo = tmp / "hub" / "models--org--tiny"
    (repo / "snapshots" / REVISION).mkdir(parents=True)
    target(repo / "refs" / "main")
    return "org/tiny"


def _config_value(tmp, trained, **changes):
    hf = _hf_copy(tmp, trained)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, **changes}))
    return hf


def _tokenizer_dir_with_fifo_config(tmp):
    from llama_reference import tokenizer_json

    directory = tmp / "tok"
    directory.mkdir()
    tokenizer_json(directory / "tokenizer.json", 512)
    _fifo(directory / "tokenizer_config.json")
    return directory


TINY = ["--config", "tiny", "data.path=mnli-sample", "data.tokenizer=sample", "model.embedding.vocab_size=512", "model.sequence_length=32"]

# (id, setup(tmp, trained) -> CLI arguments, a fragment the one-line message must contain)
CASES = [
    # Files that are not regular files.
    ("config-json-to-dev-zero", lambda t, r: ["train", f"model.hf_checkpoint={_to_zero(t / 'hf' / 'config.json').parent}"],
     "hf/config.json is a link to a character device, not a regular file"),
    ("config-json-fifo", lambda t, r: ["train", f"model.hf_checkpoint={_fifo(t / 'hf' / 'config.json').parent}"],
     "hf/config.json is a FIFO (named pipe), not a regular file"),
    ("config-json-directory", lambda t, r: ["train", f"model.hf_checkpoint={(t / 'hf' / 'config.json').mkdir(parents=True) or t / 'hf'}"],
     "hf/config.json is a directory, not a regular file"),
    ("shard-fifo", lambda t, r: ["train", "data.path=null", f"model.hf_checkpoint={_shard_is_fifo(t, r)}"],
     "model-00001-of-00001.safetensors is a FIFO (named pipe), not a regular file"),
    ("hub-ref-to-dev-zero", lambda t, r: ["train", f"model.hf_checkpoint={_hub_ref(t, _to_zero)}"],
     "refs/main is a link to a character device, not a regular file"),
    ("hub-ref-fifo", lambda t, r: ["train", f"model.hf_checkpoint={_hub_ref(t, _fifo)}"],
     "refs/main is a FIFO (named pipe), not a regular file"),
    ("preset-fifo", lambda t, r: ["train", "--config", str(_fifo(t / "preset.yaml"))],
     "preset.yaml is a FIFO (named pipe), not a regular file"),
    ("preset-to-dev-zero", lambda t, r: ["plan", "--config", str(_to_zero(t / "preset.yaml"))],
     "preset.yaml is a link to a character device, not a regular file"),
    ("tokenizer-to-dev-zero", lambda t, r: ["train", *TINY, f"data.tokenizer={_to_zero(t / 'tokenizer.json')}"],
     "data.tokenizer: " + "{t}/tokenizer.json is a link to a character device, not a regular file"),
    ("tokenizer-config-fifo", lambda t, r: ["train", *TINY, f"data.tokenizer={_tokenizer_dir_with_fifo_config(t)}"],
     "tok/tokenizer_config.json is a FIFO (named pipe), not a regular file"),
    ("data-fifo", lambda t, r: ["train", *TINY, f"data.path={_fifo(t / 'rows.jsonl')}"], "rows.jsonl is not a regular file"),
    ("prompts-fifo", lambda t, r: ["generate", "--checkpoint", str(_checkpoint(t, r)), "--prompts", str(_fifo(t / "p.txt"))],
     "p.txt: is a FIFO (named pipe), not a regular file"),
    # Weights that do not match their index or their config.json.
    ("index-misplaces-a-tensor", lambda t, r: ["train", "data.path=null", f"model.hf_checkpoint={_index_misplaces(t, r)}"],
     "in model-00002-of-00002.safetensors, which does not hold it; the index does not match its weight files"),
    ("gptj-more-layers-than-config", lambda t, r: ["train", "data.path=null", f"model.hf_checkpoint={_fewer_layers(t, r)}"],
     "its weights hold layer 1 (transformer.h.1."),
    ("llama-more-layers-than-config", lambda t, r: ["train", "data.path=null", f"model.hf_checkpoint={_llama_extra_layers(t, r)}"],
     "its weights hold layer 5 (model.layers.5."),
    # --trace where nothing can be written.
    ("trace-into-proc", lambda t, r: ["bench", "--config", "tiny", "--steps", "1", "--trace", "/proc/ipuft-trace.json"],
     "--trace /proc/ipuft-trace.json: cannot be written"),
    ("trace-onto-a-fifo", lambda t, r: ["bench", "--config", "tiny", "--steps", "1", "--trace", str(_fifo(t / "t.json"))],
     "t.json: exists and is not a regular file; give a regular file"),
    # Values of the wrong type, named as what they are.
    ("config-int-as-string", lambda t, r: ["train", f"model.hf_checkpoint={_config_value(t, r, n_embd='64')}"],
     "n_embd must be a positive integer, got the string '64'"),
    ("config-int-as-list", lambda t, r: ["train", f"model.hf_checkpoint={_config_value(t, r, n_layer=[2])}"],
     "n_layer must be a positive integer, got a list ([2])"),
    ("config-int-as-boolean", lambda t, r: ["train", f"model.hf_checkpoint={_config_value(t, r, n_head=True)}"],
     "n_head must be a positive integer, got the boolean true"),
]


@pytest.mark.parametrize(("args", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_hostile_file_is_one_clear_line(tmp_path, trained, capsys, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    argv = args(tmp_path, trained)
    capsys.readouterr()  # what making the files printed (transformers' progress bars)
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, *argv)
    err = without_recipe(err)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("ipuft: error: "), err
    assert fragment.format(t=tmp_path) in err, err
    assert "Traceback" not in err
    assert snapshot(tmp_path) == before  # nothing written, nothing damaged, the FIFOs still there


def test_the_reader_bounds_what_it_reads_not_what_stat_says(tmp_path):
    """A device says its size is 0; the reader reads at most one byte past its limit and refuses it anyway
    (named as a device). A regular file's limit is exact."""
    with pytest.raises(CheckpointError, match=r"^/dev/zero is a character device, not a regular file$"):
        read_bounded("/dev/zero", 16, "/dev/zero")
    exact = tmp_path / "exact.json"
    exact.write_bytes(b"[" + b" " * 14 + b"]")
    assert read_json(exact, 16, "exact.json") == []
    exact.write_bytes(b"[" + b" " * 15 + b"]")
    with pytest.raises(DataError, match=r"^exact.json is larger than 16 bytes; a hint$"):
        read_bounded(exact, 16, "exact.json", DataError, "; a hint")
    with pytest.raises(ConfigError, match=r"^gone does not exist$"):
        read_bounded(tmp_path / "gone", 16, "gone", ConfigError)
    with pytest.raises(CheckpointError, match=r"^shard is a FIFO \(named pipe\), not a regular file$"):
        require_regular(_fifo(tmp_path / "fifo"), "shard")
    require_regular(exact, "exact.json")


@pytest.fixture
def probe(monkeypatch, tmp_path):
    """A faked probe (float32 at 95 GFLOP/s, bfloat16 at 1) in a cache of this test's own; the probes counted."""
    monkeypatch.setenv("IPUFT_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def rate(dtype, n=kernels.PROBE):
        calls.append(dtype)
        return 95e9 if dtype == torch.float32 else 1e9

    monkeypatch.setattr(kernels, "probe_rate", rate)
    return calls


@pytest.mark.parametrize("rates", [{"float32": 1e300, "bfloat16": 1e9}, {"float32": 95e9, "bfloat16": 1e-300},
                                   {"float32": 2e16, "bfloat16": 1e9}, {"float32": 95e9, "bfloat16": 10.0}])
def test_impossible_cached_rates_are_measured_again(probe, tmp_path, rates):
    """A kernels.json rate no CPU has (above 1e16 FLOP/s, or a probe that would take minutes) is not trusted:
    measured again and rewritten, so no warning shows a 300-digit figure."""
    cache = tmp_path / "cache" / kernels.CACHE_FILE
    cache.parent.mkdir()
    cache.write_text(json.dumps({kernels.cpu_identity(): rates}))
    assert kernels.measured_rates((torch.float32, torch.bfloat16)) == {"float32": 95e9, "bfloat16": 1e9}
    assert probe == [torch.float32, torch.bfloat16]
    assert json.loads(cache.read_text()) == {kernels.cpu_identity(): {"float32": 95e9, "bfloat16": 1e9}}


@pytest.mark.parametrize("make", [_fifo, _to_zero], ids=["fifo", "dev-zero"])
def test_a_kernels_json_that_is_not_a_file_is_measured_again(probe, tmp_path, make):
    """Never waited on nor read without end: read as no cache, measured, and the link or FIFO replaced by the
    cache file (the target, /dev/zero, untouched)."""
    cache = make(tmp_path / "cache" / kernels.CACHE_FILE)
    assert kernels.measured_rates((torch.float32,)) == {"float32": 95e9}
    assert probe == [torch.float32]
    assert cache.is_file() and not cache.is_symlink()
    assert json.loads(cache.read_text()) == {kernels.cpu_identity(): {"float32": 95e9}}


def test_a_trace_torch_fails_to_write_is_an_error(tmp_path, capsys, monkeypatch):
    """torch's exporter does not say when it writes nothing: bench checks, and says so in one line instead of
    "wrote"; no file, no temporary left."""
    from torch.profiler import profile

    monkeypatch.setattr(profile, "export_chrome_trace", lambda self, path: None)
    trace = tmp_path / "step.json"
    code, out, err = run_cli(capsys, "bench", "--config", "tiny", "--steps", "1", "--trace", str(trace))
    assert code == 2 and "wrote" not in out
    assert err == f"ipuft: error: --trace {trace}: torch.profiler wrote nothing (is its file system full?)\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("value", "words"), [
    ("4", "the string '4'"), (True, "the boolean true"), ([64], "a list ([64])"), ({"a": 1}, "an object ({'a': 1})"),
    (-3, "-3"), (2.5, "2.5"), ("x" * 100, "the string '" + "x" * 40 + "'"),
])
def test_config_values_are_named_with_their_type(value, words):
    assert shown(value) == words
    with pytest.raises(HFConfigError, match=r"^n must be a positive integer, got (.*)$") as info:
        config_int({"n": value}, "n")
    assert str(info.value).endswith(f"got {words}")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        with pytest.raises(HFConfigError) as info:
            config_float({"x": value}, "x")
        assert str(info.value) == f"x must be a number in (0, inf), got {words}"
    if not isinstance(value, bool):
        with pytest.raises(HFConfigError) as info:
            config_flag({"f": value}, "f", False)
        assert str(info.value) == f"f must be true or false, got {words}"
