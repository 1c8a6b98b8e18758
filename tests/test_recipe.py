"""The fine-tuning recipe of a checkpoint given without --config (``finetune``, not the small-cpu preset's toy
recipe): the one line that names it, the values it resolves to, the precision the device decides (the 16-bit
probe faked), and a shipped preset's recipe over a checkpoint of another shape."""

import pytest
import torch
from cli_helpers import run_cli
from llama_reference import save_hf
from omegaconf import OmegaConf

import ipuft.kernels as kernels
from ipuft.config import load_config

CAPABILITY = torch.backends.cpu.get_cpu_capability()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A random tiny Llama (48 wide, 2 of 6 heads for keys and values) made for 4096 positions."""
    return save_hf(tmp_path_factory.mktemp("recipe") / "llama", "llama", max_position_embeddings=4096)[1]


@pytest.fixture
def bfloat16_rate(monkeypatch, tmp_path):
    """Fake the probe in a cache of this test's own: float32 at 95 GFLOP/s, bfloat16 at the rate given."""
    monkeypatch.setenv("IPUFT_CACHE_DIR", str(tmp_path / "cache"))

    def fake(rate: float):
        monkeypatch.setattr(kernels, "probe_rate", lambda dtype, n=kernels.PROBE: 95e9 if dtype == torch.float32 else rate)

    return fake


def preset_part(*typed: str) -> str:
    values = {"training.optimizer.learning_rate.maximum": "2e-05", "training.optimizer.learning_rate.schedule": "cosine",
              "training.optimizer.learning_rate.warmup_proportion": "0.03", "training.global_batch_size": "16",
              "training.steps": "100", "data.path": "mnli-sample"}
    return ", ".join(f"{k}={v}" for k, v in values.items() if k not in typed) + " (the preset's)"


def test_a_checkpoint_without_config_takes_the_finetune_recipe_and_says_so(capsys, llama_dir, bfloat16_rate):
    bfloat16_rate(1.0e9)  # no native bfloat16 kernels: float32
    code, out, err = run_cli(capsys, "config", "show", f"model.hf_checkpoint={llama_dir}")
    assert code == 0, err
    assert err == ("ipuft: recipe finetune, as model.hf_checkpoint is given without --config: model.sequence_length="
                   "2048 (the checkpoint's max_position_embeddings=4096, at most 2048); model.precision=float32 (this "
                   "CPU multiplies bfloat16 matrices at 1.0 GFLOP/s against 95.0 GFLOP/s in float32); "
                   f"{preset_part()}; --config PRESET or KEY=VALUE sets any of them\n")
    cfg = OmegaConf.create(out)
    lr = cfg.training.optimizer.learning_rate
    assert (lr.maximum, lr.schedule, lr.warmup_proportion) == (2e-5, "cosine", 0.03)
    assert (cfg.training.steps, cfg.training.global_batch_size, cfg.execution.micro_batch_size) == (100, 16, 1)
    assert (cfg.model.sequence_length, cfg.model.precision, cfg.training.stochastic_rounding) == (2048, "float32", False)
    assert (cfg.plugins.adamw.weight_decay, cfg.data.path, cfg.data.tokenizer) == (0.0, "mnli-sample", None)
    # The checkpoint's model, not small-cpu's GPT-J.
    assert (cfg.model.family, cfg.model.hidden_size, cfg.plugins.llama.kv_heads) == ("llama", 48, 2)


def test_a_device_fast_at_bfloat16_trains_in_it_with_stochastic_rounding(capsys, llama_dir, bfloat16_rate):
    bfloat16_rate(400e9)  # AMX: bfloat16 outruns float32
    code, out, err = run_cli(capsys, "config", "show", f"model.hf_checkpoint={llama_dir}", "model.sequence_length=32")
    assert code == 0, err
    assert ("model.sequence_length=32 (yours); model.precision=bfloat16 with training.stochastic_rounding=true (this "
            "CPU multiplies bfloat16 matrices at 400.0 GFLOP/s against 95.0 GFLOP/s in float32); ") in err
    cfg = OmegaConf.create(out)
    assert (cfg.model.precision, cfg.training.stochastic_rounding, cfg.model.sequence_length) == ("bfloat16", True, 32)
    # A 16-bit recipe the user chose stays theirs; so does a precision they typed.
    code, out, err = run_cli(capsys, "config", "show", f"model.hf_checkpoint={llama_dir}", "training.master_weights=true")
    cfg = OmegaConf.create(out)
    assert code == 0 and "model.precision=bfloat16 (this CPU" in err
    assert (cfg.model.precision, cfg.training.stochastic_rounding, cfg.training.master_weights) == ("bfloat16", False, True)
    code, out, err = run_cli(capsys, "config", "show", f"model.hf_checkpoint={llama_dir}", "model.precision=float32")
    assert code == 0 and "model.precision=float32 (yours)" in err and OmegaConf.create(out).model.precision == "float32"


def test_a_gpu_decides_by_its_compute_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    for capability, fast in (((7, 0), False), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        has = "has" if fast else "has no"
        assert kernels.fast_bfloat16(cuda) == (fast, f"NVIDIA H200, compute capability {capability[0]}.0, {has} "
                                                     f"bfloat16 arithmetic")


def test_the_recipe_trains_and_is_the_runs_config(capsys, llama_dir, bfloat16_rate, tmp_path):
    bfloat16_rate(1.0e9)
    code, _, err = run_cli(capsys, "train", f"model.hf_checkpoint={llama_dir}", "training.steps=1",
                           "training.global_batch_size=2", "model.sequence_length=16", f"output_dir={tmp_path}/run")
    assert code == 0, err
    (line,) = [line for line in err.splitlines() if line.startswith("ipuft: recipe ")]
    assert line.endswith(f"{preset_part('training.global_batch_size', 'training.steps')}; "
                         "training.global_batch_size=2, training.steps=1 (yours); --config PRESET or KEY=VALUE sets "
                         "any of them")
    saved = OmegaConf.load(tmp_path / "run" / "config.yaml")
    assert (saved.training.optimizer.learning_rate.maximum, saved.model.sequence_length) == (2e-5, 16)
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1


def test_a_chosen_preset_keeps_its_recipe_over_a_checkpoint_of_another_shape(capsys, hooks, llama_dir):
    """``--config llama3-8b`` of a 48-wide Llama: the shapes, the options and the tokens are the checkpoint's,
    the precision, the batch and the schedule the preset's; no recipe line, as the user chose one."""
    code, out, err = run_cli(capsys, "config", "show", "--config", "llama3-8b", f"model.hf_checkpoint={llama_dir}")
    assert (code, err) == (0, "")
    cfg = OmegaConf.create(out)
    m = cfg.model
    assert (m.layers, m.hidden_size, m.intermediate_size, m.embedding.vocab_size) == (2, 48, 80, 101)
    assert (m.attention.heads, m.attention.rotary_positional_embeddings_base, cfg.plugins.llama.kv_heads) == (6, 5000.0, 2)
    assert (m.bos_token_id, list(m.eos_token_ids), cfg.plugins.llama.rope_scaling.original_max_position_embeddings) == (
        1, [2], 16)
    assert (m.precision, cfg.training.stochastic_rounding, cfg.training.global_batch_size) == ("bfloat16", True, 128)
    assert (cfg.training.optimizer.learning_rate.maximum, m.sequence_length) == (1e-5, 2048)
    # A preset of GPT-J's family too: its recipe, the Llama's model.
    cfg = load_config("gptj-6b", [f"model.hf_checkpoint={llama_dir}"], hooks.registrations.config_sections)
    assert (cfg.model.decoder, cfg.model.hidden_size, cfg.model.precision.value, cfg.execution.loss_scaling) == (
        "llama", 48, "float16", 4096)
