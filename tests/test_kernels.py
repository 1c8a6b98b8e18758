"""The fast-kernel check: a 16-bit run on a CPU whose 16-bit matmuls are slow gets one warning line from every
command that computes (the probe faked), the probe is cached per machine, and a GPU without bfloat16 is refused."""

import json

import pytest
import torch
from cli_helpers import run_cli

import ipuft.kernels as kernels
from ipuft.errors import ConfigError

BF16 = ("model.precision=bfloat16", "training.stochastic_rounding=true")
TINY = ("--config", "tiny", "training.steps=1", "training.global_batch_size=2", "checkpoint.save=null")


@pytest.fixture
def probe(monkeypatch, tmp_path):
    """A faked probe in a cache of this test's own: float32 at 95 GFLOP/s, the 16-bit dtypes as the test says;
    the probes run are counted."""
    monkeypatch.setenv("IPUFT_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fake(slow: float):
        def rate(dtype, n=kernels.PROBE):
            calls.append(dtype)
            return 95e9 if dtype == torch.float32 else slow
        monkeypatch.setattr(kernels, "probe_rate", rate)
        return calls

    return fake


def warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("ipuft: warning: model.precision=")]


@pytest.mark.parametrize("command", [("plan",), ("bench", "--steps", "1"), ("train",)])
def test_a_slow_16bit_cpu_gets_one_warning_line(capsys, probe, tmp_path, command):
    probe(1.0e9)  # an AVX2 CPU's bfloat16 matmul
    code, _, err = run_cli(capsys, *command, *TINY, *BF16, f"output_dir={tmp_path}/run")
    assert code == 0, err
    (line,) = warnings(err)
    assert line == ("ipuft: warning: model.precision=bfloat16: this CPU (" + torch.backends.cpu.get_cpu_capability()
                    + ") multiplies bfloat16 matrices at 1.0 GFLOP/s against 95.0 GFLOP/s in float32 (no native "
                      "bfloat16 kernels), so a step would take about 95x as long as in float32; set "
                      "model.precision=float32")


def test_generate_and_eval_warn_too(capsys, probe, trained):
    """The checkpoint's precision is the run's: a bfloat16 one on a slow CPU."""
    probe(2.0e9)
    run = trained / "bf16"
    code, _, err = run_cli(capsys, "train", *TINY, *BF16, "model.embedding.vocab_size=512", f"output_dir={run}",
                           "checkpoint.save=" + str(run / "checkpoints"))
    assert code == 0, err
    for args in (("generate", "--checkpoint", str(run), "--max-new-tokens", "2", "hello", "data.tokenizer=sample"),
                 ("eval", "--checkpoint", str(run), "data.path=mnli-sample", "data.tokenizer=sample")):
        code, _, err = run_cli(capsys, *args)
        assert code == 0, err
        (line,) = warnings(err)
        assert "2.0 GFLOP/s against 95.0 GFLOP/s" in line and line.endswith("set model.precision=float32")


def test_fast_16bit_and_float32_say_nothing(capsys, probe):
    calls = probe(400e9)  # native bfloat16 (AMX) outruns float32
    code, _, err = run_cli(capsys, "plan", *TINY, *BF16)
    assert code == 0 and warnings(err) == []
    assert calls == [torch.float32, torch.bfloat16]
    code, _, err = run_cli(capsys, "plan", *TINY)
    assert code == 0 and warnings(err) == [] and len(calls) == 2  # float32 needs no probe


def test_the_probe_is_cached_per_machine_and_a_bad_cache_is_measured_again(probe, tmp_path, make_config):
    calls = probe(1.0e9)
    cfg = make_config(*BF16)
    cpu = torch.device("cpu")
    first = kernels.slow_precision_warning(cfg, cpu)
    assert first is not None and len(calls) == 2
    assert kernels.slow_precision_warning(cfg, cpu) == first and len(calls) == 2  # from the cache
    path = tmp_path / "cache" / kernels.CACHE_FILE
    entries = json.loads(path.read_text())
    assert entries == {kernels.cpu_identity(): {"float32": 95e9, "bfloat16": 1.0e9}}
    for bad in ("not json", json.dumps([1, 2]), json.dumps({kernels.cpu_identity(): {"float32": "fast"}}),
                json.dumps({kernels.cpu_identity(): {"float32": -1.0, "bfloat16": 1.0}})):
        path.write_text(bad)
        assert kernels.slow_precision_warning(cfg, cpu) == first
        assert json.loads(path.read_text()) == entries  # measured again and rewritten
    assert len(calls) == 2 + 2 * 4
    assert kernels.slow_precision_warning(cfg, torch.device("cuda")) is None  # a GPU is not probed


def test_a_gpu_without_bfloat16_is_refused(monkeypatch, make_config):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    cuda = torch.device("cuda", 0)
    for capability, refused in (((7, 0), True), ((8, 0), False), ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        if refused:
            with pytest.raises(ConfigError, match=r"^model.precision=bfloat16: Tesla V100-SXM2-16GB \(compute "
                                                  r"capability 7.0\) has no bfloat16 arithmetic, which needs 8.0"):
                kernels.require_precision_support(make_config(*BF16), cuda)
        else:
            kernels.require_precision_support(make_config(*BF16), cuda)
        kernels.require_precision_support(make_config("model.precision=float16", "training.stochastic_rounding=true",
                                                      "execution.loss_scaling=dynamic"), cuda)
        kernels.require_precision_support(make_config(), cuda)
