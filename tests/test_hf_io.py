"""Hugging Face checkpoints in and out: shapes from config.json, bit-exact round trips, train then reload."""

import json

import pytest
import torch
from hf_reference import hf_gptj
from safetensors.torch import load_file

from ipuft.config import load_config
from ipuft.errors import CheckpointError, ConfigError
from ipuft.io.checkpoint import find_checkpoint
from ipuft.run.export import export_hf
from ipuft.run.runtime import build_engine
from ipuft.run.train import train


def save_hf(tmp_path, cfg, how="safetensors", name="hf"):
    model = hf_gptj(cfg, seed=3)
    out = tmp_path / name
    if how == "safetensors":
        model.save_pretrained(out, safe_serialization=True)
    elif how == "sharded":
        model.save_pretrained(out, safe_serialization=True, max_shard_size="40KB")
        assert (out / "model.safetensors.index.json").exists()
    else:  # the older pickle format (transformers 5 writes only safetensors): weights_only on load
        model.config.save_pretrained(out)
        torch.save(model.state_dict(), out / "pytorch_model.bin")
    return model, out


def load_state(directory):
    files = sorted(directory.glob("*.safetensors"))
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


@pytest.mark.parametrize("how", ["safetensors", "sharded", "bin"])
def test_round_trip_is_bit_exact(hooks, tmp_path, how):
    cfg0 = load_config("tiny", [], hooks.registrations.config_sections)
    model, src = save_hf(tmp_path, cfg0, how)
    cfg = load_config(None, [f"model.hf_checkpoint={src}", "model.sequence_length=8", "training.global_batch_size=2",
                             f"output_dir={tmp_path}/run"], hooks.registrations.config_sections)
    assert (cfg.model.layers, cfg.model.hidden_size, cfg.model.embedding.vocab_size) == (2, 64, 128)
    engine = build_engine(cfg, hooks)
    from ipuft.io.checkpoint import Contents, save_checkpoint

    ckpt = save_checkpoint(Contents.of(engine.model.full_weights()), cfg, tmp_path / "ckpts", 0)
    out = export_hf(ckpt, tmp_path / "exported", hooks, shard_bytes=50_000)
    assert (out / "model.safetensors.index.json").exists()  # the tiny model spans several 50 kB shards
    exported = load_state(out)
    original = {k: v for k, v in model.state_dict().items()}
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
def test_a_float16_checkpoint_streams_into_any_precision_and_exports_in_any_dtype(hooks, tmp_path, precision):
    cfg0 = load_config("tiny", [], hooks.registrations.config_sections)
    model = hf_gptj(cfg0, seed=3).half()
    model.save_pretrained(tmp_path / "hf16")
    cfg = load_config(None, [f"model.hf_checkpoint={tmp_path / 'hf16'}", "model.sequence_length=8",
                             "training.global_batch_size=2", f"model.precision={precision}"],
                      hooks.registrations.config_sections)
    engine = build_engine(cfg, hooks)
    dtype = getattr(torch, precision)
    from ipuft.io.checkpoint import Contents, save_checkpoint

    ckpt = save_checkpoint(Contents.of(engine.model.full_weights()), cfg, tmp_path / "ckpts", 0)
    assert all(t.dtype == dtype for t in load_file(str(ckpt / "model.safetensors")).values())
    for exported_dtype in ("float16", "float32", None):
        out = export_hf(ckpt, tmp_path / f"out-{exported_dtype}", hooks, dtype=exported_dtype)
        written = json.loads((out / "config.json").read_text())["torch_dtype"]
        assert written == (exported_dtype or precision)
        exported = load_state(out)
        for name, tensor in model.state_dict().items():
            # float16 → the training precision (exact into float32, rounded into bfloat16) → the export dtype
            expected = tensor.to(dtype).to(getattr(torch, written))
            assert torch.equal(exported[name], expected), name


def test_shapes_from_config_json_and_every_mismatch_listed(hooks, tmp_path):
    """A shipped preset's shapes yield to the checkpoint's and its recipe stays; keys the user typed, in
    overrides or in a YAML file of theirs (not in its shipped base), are checked, every mismatch in one line."""
    sections = hooks.registrations.config_sections
    cfg0 = load_config("tiny", [], sections)
    _, src = save_hf(tmp_path, cfg0)
    cfg = load_config("small-cpu", [f"model.hf_checkpoint={src}"], sections)
    assert (cfg.model.layers, cfg.model.hidden_size, cfg.model.embedding.vocab_size) == (2, 64, 128)
    assert (cfg.training.steps, cfg.training.optimizer.learning_rate.maximum, cfg.model.sequence_length) == (100, 3e-3, 8)
    mine = tmp_path / "mine.yaml"
    mine.write_text("base: small-cpu\nmodel:\n  layers: 4\n  hidden_size: 128\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(mine), [f"model.hf_checkpoint={src}", "model.embedding.vocab_size=512"], sections)
    message = str(info.value)
    for fragment in ("model.layers=4 but the checkpoint has n_layer=2", "model.hidden_size=128 but the checkpoint "
                     "has n_embd=64", "model.embedding.vocab_size=512 but the checkpoint has vocab_size=128"):
        assert fragment in message
    assert "\n" not in message


def test_bad_hf_directories(hooks, tmp_path):
    sections = hooks.registrations.config_sections
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_config(None, [f"model.hf_checkpoint={tmp_path}/nope"], sections)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        load_config(None, [f"model.hf_checkpoint={tmp_path}/empty"], sections)
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(CheckpointError, match="model_type 'bert'; the installed plugins read 'gemma2', 'gemma3_text', 'gptj', 'llama'"):
        load_config(None, [f"model.hf_checkpoint={tmp_path}/bert"], sections)
    cfg0 = load_config("tiny", [], sections)
    _, src = save_hf(tmp_path, cfg0)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    cfg = load_config(None, [f"model.hf_checkpoint={src}", "model.sequence_length=8",
                             "training.global_batch_size=2"], sections)
    with pytest.raises(CheckpointError, match=r"model\.safetensors cannot be read"):
        build_engine(cfg, hooks)


def test_train_from_hf_then_export_and_transformers_reloads(hooks, tmp_path):
    from transformers import GPTJForCausalLM

    cfg0 = load_config("tiny", [], hooks.registrations.config_sections)
    model, src = save_hf(tmp_path, cfg0)
    run = tmp_path / "run"
    cfg = load_config(None, [f"model.hf_checkpoint={src}", "model.sequence_length=8", "training.global_batch_size=4",
                             "training.steps=3", "training.optimizer.learning_rate.maximum=1e-3", f"output_dir={run}"],
                      hooks.registrations.config_sections)
    records = train(cfg, hooks, progress=False)
    assert len(records) == 3
    checkpoint = find_checkpoint(run)
    assert checkpoint.name == "step-00000003"
    out = export_hf(run, tmp_path / "exported", hooks)
    reloaded = GPTJForCausalLM.from_pretrained(out).eval()
    trained = load_state(out)
    changed = [n for n, t in model.state_dict().items() if not torch.equal(trained[n], t)]
    assert len(changed) == len(trained)  # three steps of Adam move every tensor
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    # The reloaded model's logits are those of ipuft's trained weights.
    engine_cfg = load_config(str(checkpoint / "config.yaml"), [f"checkpoint.load={run}"],
                             hooks.registrations.config_sections)
    engine = build_engine(engine_cfg, hooks)
    from torch.func import functional_call

    w = engine.model.weights()
    with torch.no_grad():
        h = functional_call(engine.modules["embeddings"], w["embeddings"], (ids,))
        for n in range(2):
            h = functional_call(engine.modules["decoder"], w[f"decoder.{n}"], (h,))
        ours = functional_call(engine.modules["head"], w["head"], (h,))
        theirs = reloaded(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_a_run_from_a_runs_checkpoint_carries_the_source_config_into_its_export(hooks, tmp_path):
    """model.init_checkpoint takes the model's own files from the checkpoint it starts from, so the second run's
    export still writes the source's config.json (its n_positions, not max(sequence, 2048)) and
    generation_config.json."""
    cfg0 = load_config("tiny", ["model.sequence_length=32"], hooks.registrations.config_sections)
    _, src = save_hf(tmp_path, cfg0)
    common = ["model.sequence_length=8", "training.global_batch_size=4", "training.steps=1"]
    first, second = tmp_path / "first", tmp_path / "second"
    train(load_config(None, [f"model.hf_checkpoint={src}", *common, f"output_dir={first}"],
                      hooks.registrations.config_sections), hooks, progress=False)
    train(load_config(None, [f"model.init_checkpoint={first}", *common, f"output_dir={second}"],
                      hooks.registrations.config_sections), hooks, progress=False)
    out = export_hf(second, tmp_path / "exported", hooks)
    source = json.loads((src / "config.json").read_text())
    assert source["n_positions"] == 32
    assert json.loads((out / "config.json").read_text()) == source
    assert (out / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()


def test_export_refuses_a_non_empty_directory(hooks, tmp_path):
    run = tmp_path / "run"
    train(load_config("tiny", ["training.steps=1", f"output_dir={run}"], hooks.registrations.config_sections),
          hooks, progress=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not an empty directory"):
        export_hf(run, out, hooks)
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(CheckpointError, match="neither an ipuft checkpoint"):
        export_hf(tmp_path, tmp_path / "out2", hooks)


def test_a_checkpoint_of_odd_shape_trains_with_no_preset_and_only_typed_keys_conflict(hooks, tmp_path, capsys):
    """``ipuft train model.hf_checkpoint=DIR`` with no --config: the checkpoint defines the model (and its
    tokenizer is the run's), whatever the default preset's shapes are."""
    import shutil

    from cli_helpers import run_cli
    from omegaconf import OmegaConf

    from ipuft.data.tokenizer import tokenizer_path

    odd = load_config("tiny", ["model.layers=3", "model.hidden_size=48", "model.attention.heads=3",
                               "model.attention.rotary_dim=8", "model.embedding.vocab_size=520"],
                      hooks.registrations.config_sections)
    hf = tmp_path / "odd"
    hf_gptj(odd, seed=5).save_pretrained(hf)
    shutil.copyfile(tokenizer_path("sample"), hf / "tokenizer.json")
    code, _, err = run_cli(capsys, "train", f"model.hf_checkpoint={hf}", "training.steps=2",
                           f"output_dir={tmp_path}/run")
    assert code == 0, err
    saved = OmegaConf.load(tmp_path / "run" / "config.yaml")
    assert (saved.model.layers, saved.model.hidden_size, saved.model.attention.heads) == (3, 48, 3)
    assert (saved.model.attention.rotary_dim, saved.model.embedding.vocab_size) == (8, 520)
    assert saved.data.tokenizer is None  # the checkpoint's tokenizer.json, not the default preset's sample
    code, _, err = run_cli(capsys, "train", f"model.hf_checkpoint={hf}", "model.hidden_size=64",
                           f"output_dir={tmp_path}/typed")
    assert code == 2
    assert err == (f"ipuft: error: model.hf_checkpoint {hf}: model.hidden_size=64 but the checkpoint has n_embd=48 "
                   f"(drop those settings: the checkpoint's config.json fixes the model)\n")


def test_a_hub_name_resolves_from_the_local_cache_without_network(hooks, tmp_path, monkeypatch, capsys):
    """``model.hf_checkpoint=org/name``: the snapshot ``refs/main`` names in ``HF_HOME/hub``, as transformers
    finds it with ``local_files_only=True``; a name not there is one line saying where it looked."""
    from cli_helpers import run_cli

    cfg0 = load_config("tiny", [], hooks.registrations.config_sections)
    model = hf_gptj(cfg0, seed=3)
    repo = tmp_path / "hf-home" / "hub" / "models--someone--tiny-gptj"
    revision = "0123456789abcdef0123456789abcdef01234567"
    model.save_pretrained(repo / "snapshots" / revision)
    (repo / "snapshots" / ("f" * 40)).mkdir()  # an older snapshot refs/main does not name
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision + "\n")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()  # transformers' progress bars
    cfg = load_config(None, ["model.hf_checkpoint=someone/tiny-gptj", "model.sequence_length=8",
                             "training.global_batch_size=2"], hooks.registrations.config_sections)
    assert cfg.model.hf_checkpoint == str(repo / "snapshots" / revision)
    engine = build_engine(cfg, hooks)
    assert torch.equal(engine.model.weights()["embeddings"]["wte.weight"], model.state_dict()["transformer.wte.weight"])
    code, _, err = run_cli(capsys, "plan", "model.hf_checkpoint=someone/absent")
    assert code == 2
    assert err == (f"ipuft: error: model.hf_checkpoint: someone/absent is neither a directory nor in the local "
                   f"Hugging Face cache (looked in {tmp_path / 'hf-home' / 'hub' / 'models--someone--absent'}; set "
                   f"HF_HOME or HF_HUB_CACHE); ipuft never downloads: fetch it where there is network "
                   f"(huggingface-cli download someone/absent) and copy the cache or the snapshot directory here\n")
    (repo / "refs" / "main").write_text("../../../../etc")  # refs/main is data, never a path
    code, _, err = run_cli(capsys, "plan", "model.hf_checkpoint=someone/tiny-gptj")
    assert code == 2 and "does not name one snapshot" in err


# Each is a plugin overriding a stock component (tryfirst) with a Hugging Face mapping problem.
_STOCK_HEAD = """
import torch
from ipuft import hookimpl
from ipuft_lm_head import SHARD_SPECS, build as stock_build

class Head(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.inner = stock_build(cfg)
        self.norm, self.proj = self.inner.norm, self.inner.proj
    def forward(self, hidden, labels=None):
        return self.inner(hidden, labels)
    def variable_specs(self):
        return self.inner.variable_specs()
    def hf_mapping(self, layer=None):
        return MAPPING
{extra}
@hookimpl(tryfirst=True)
def ipuft_register_components(registry):
    registry.add("head", "gptj", Head, "a head with a mapping problem", shard_specs=SHARD_SPECS)
"""
_STOCK_MAPPING = ('{"norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias", '
                  '"proj.weight": "lm_head.weight", "proj.bias": "lm_head.bias"}')
BAD_EXPORTS = {
    "no-hf-names": ("{}", "", "model.head: variable norm.weight of Head has no Hugging Face name (hf_mapping) and is "
                    "not added; the export would lose it"),
    "onto-the-embeddings": (_STOCK_MAPPING.replace("lm_head.weight", "transformer.wte.weight"), "",
                            "embeddings.wte.weight and head.proj.weight both map to the Hugging Face name "
                            "transformer.wte.weight; one would overwrite the other"),
    "not-gpt-j": (_STOCK_MAPPING.replace("lm_head.bias", "score.bias"), "",
                  "the export would not be a complete GPT-J: it lacks lm_head.bias"),
    "not-exportable": (_STOCK_MAPPING, "    hf_exportable = False\n",
                       "model.head: Head is not exportable to a Hugging Face GPT-J (it sets hf_exportable = False)"),
}


@pytest.mark.parametrize("case", sorted(BAD_EXPORTS))
def test_an_export_that_would_write_a_wrong_model_is_refused(trained, tmp_path, fake_dist, capsys, case):
    """One line, exit 2, and no directory written: a variable without a Hugging Face name, two variables under
    one name, a result that is not a complete GPT-J, a component that is not exportable."""
    from cli_helpers import run_cli

    mapping, extra, message = BAD_EXPORTS[case]
    fake_dist("ipuft-bad-head", {"bad_head": "bad_head_plugin"},
              {"bad_head_plugin": _STOCK_HEAD.replace("MAPPING", mapping).replace("{extra}", extra)})
    out = tmp_path / "hf"
    code, _, err = run_cli(capsys, "export", "--checkpoint", str(trained / "run"), "--hf", str(out))
    assert (code, err) == (2, f"ipuft: error: {message}\n")
    # Only the fake plugin's own files (and the bytecode of its import, where Python writes it) are there.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == [
        "bad_head_plugin.py", "ipuft_bad_head-0.1.0.dist-info"]


def test_a_decoder_that_does_not_give_its_activation_is_not_exported(trained, tmp_path, fake_dist, capsys):
    from cli_helpers import run_cli

    fake_dist("ipuft-quiet", {"quiet": "quiet_plugin"}, {"quiet_plugin": """
        from ipuft import hookimpl
        from ipuft_decoder import SHARD_SPECS, build as stock_build

        def build(cfg):
            block = stock_build(cfg)

            class Quiet(type(block)):
                def hf_config(self):
                    return {}  # says nothing of its activation

            block.__class__ = Quiet
            return block

        @hookimpl(tryfirst=True)
        def ipuft_register_components(registry):
            registry.add("decoder", "gptj", build, "a decoder that does not say its activation", shard_specs=SHARD_SPECS)
    """})
    out = tmp_path / "hf"
    code, _, err = run_cli(capsys, "export", "--checkpoint", str(trained / "run"), "--hf", str(out))
    assert (code, err) == (2, "ipuft: error: model.decoder: Quiet does not give config.json's "
                              "activation_function (hf_config()), so the export cannot say how to run it\n")
    assert not out.exists()


@pytest.mark.parametrize("added", [False, True])
def test_importing_into_a_variable_without_a_hugging_face_name_is_one_line_unless_it_is_added(trained, tmp_path,
                                                                                              fake_dist, capsys, added):
    """A component variable with no Hugging Face name stops a run from model.hf_checkpoint with one line; the
    same variable marked ``added`` starts from its init (ones: the run starts as the plain model) and trains."""
    from cli_helpers import run_cli

    source = """
import dataclasses
import torch
from ipuft import hookimpl
from ipuft.components import Init, specs_from_module
from ipuft_lm_head import SHARD_SPECS, build as stock_build

def build(cfg):
    head = stock_build(cfg)

    class Scaled(type(head)):
        def variable_specs(self):
            inits = {"norm.weight": Init("ones"), "norm.bias": Init("zeros"), "proj.weight": Init("normal", 0.02),
                     "proj.bias": Init("zeros"), "gain": Init("ones")}
            return [dataclasses.replace(v, added=ADDED) if v.name == "gain" else v
                    for v in specs_from_module(self, inits)]

        def forward(self, hidden, labels=None):
            return super().forward(hidden * self.gain, labels)

    head.__class__ = Scaled
    head.gain = torch.nn.Parameter(torch.ones(cfg.model.hidden_size))
    return head

@hookimpl(tryfirst=True)
def ipuft_register_components(registry):
    registry.add("head", "gptj", build, "a head with an extra gain",
                 shard_specs={**SHARD_SPECS, "gain": SHARD_SPECS["norm.weight"]})
"""
    fake_dist("ipuft-gain", {"gain": "gain_plugin"}, {"gain_plugin": source.replace("ADDED", str(added))})
    code, _, err = run_cli(capsys, "train", "--config", "tiny", f"model.hf_checkpoint={trained / 'hf'}",
                           "training.steps=1", "training.global_batch_size=2", "checkpoint.save=null",
                           f"output_dir={tmp_path / 'run'}")
    if added:
        assert code == 0, err
        assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1
    else:
        assert (code, err) == (2, f"ipuft: error: model.hf_checkpoint {trained / 'hf'}: head.gain has no Hugging Face "
                                  f"name (the component's hf_mapping) and is not marked added, so it cannot start "
                                  f"from this checkpoint\n")
