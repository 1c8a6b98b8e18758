"""The bad-input corpus: each case exits non-zero with one clear line, no traceback, and damages nothing."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from cli_helpers import without_recipe

from ipuft.cli.main import main


def _checkpoint(tmp, trained):
    shutil.copytree(trained / "run", tmp / "run")
    return next((tmp / "run" / "checkpoints").glob("step-*"))


def _truncate(path: Path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _rows(tmp, name, rows):
    path = tmp / name
    path.write_text("".join((json.dumps(r) if not isinstance(r, str) else r) + "\n" for r in rows))
    return path


MNLI = {"premise": "a cat sleeps", "hypothesis": "a cat rests", "label": 0}
SAMPLE = ["data.tokenizer=sample", "model.embedding.vocab_size=512", "model.sequence_length=32"]

# (id, setup(tmp, trained) -> CLI arguments, a fragment the one-line message must contain)
# A small Llama config.json (no weights: the config is refused before any are read).
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 128}


LLAMA_BAD_HEADS = {**LLAMA, "num_attention_heads": 5}


CASES = [
    ("not-key-value", lambda t, r: ["train", "layers"], "is not KEY=VALUE"),
    ("unknown-key", lambda t, r: ["train", "model.layerz=2"], "unknown config key model.layerz"),
    ("reference-only-key", lambda t, r: ["train", "execution.attention_serialisation=2"],
     "execution.attention_serialisation is a setting of the PopXL reference with no ipuft equivalent"),
    ("wrong-type-int", lambda t, r: ["train", "training.steps=many"], "training.steps"),
    ("wrong-type-bool", lambda t, r: ["train", "execution.offload=sometimes"], "execution.offload"),
    ("unknown-preset", lambda t, r: ["train", "--config", "huge"], "unknown preset 'huge'"),
    ("bad-yaml-preset", lambda t, r: ["train", "--config", str(_write(t / "p.yaml", "model: [1, 2"))], "not valid YAML"),
    ("unknown-component", lambda t, r: ["train", "model.decoder=falcon"], "unknown decoder component 'falcon'"),
    ("unknown-optimizer", lambda t, r: ["train", "training.optimizer.name=lion"], "unknown optimizer 'lion'"),
    ("bad-choice", lambda t, r: ["train", "training.optimizer.learning_rate.schedule=step"], "expected one of"),
    ("batch-not-divisible", lambda t, r: ["train", "training.global_batch_size=15", "execution.micro_batch_size=4"],
     "is not divisible"),
    ("derived-key", lambda t, r: ["train", "gradient_accumulation=2"], "is derived"),
    ("host-optimizer-without-offload", lambda t, r: ["plan", "execution.optimizer_placement=host", "execution.offload=false"],
     "set execution.offload=true or optimizer_placement=device"),
    ("unknown-precision", lambda t, r: ["train", "model.precision=fp8"], "model.precision: Invalid value 'fp8'"),
    ("two-16bit-recipes", lambda t, r: ["train", "model.precision=bfloat16", "training.stochastic_rounding=true",
                                        "training.master_weights=true"], "set at most one of them"),
    ("negative-lr", lambda t, r: ["train", "training.optimizer.learning_rate.maximum=-1"], "must be >= 0"),
    ("bad-loss-scaling", lambda t, r: ["train", "execution.loss_scaling=lots"], "must be a finite number > 0 or 'dynamic'"),
    ("tp-does-not-divide", lambda t, r: ["plan", "execution.tensor_parallel=3"], "not divisible by execution.tensor_parallel=3"),
    ("dp-tp-world-mismatch", lambda t, r: ["train", "--config", "tiny", "execution.data_parallel=2"],
     "but 1 process was launched"),
    ("checkpoint-missing", lambda t, r: ["train", "--config", "tiny", f"checkpoint.load={t}/nope"], "does not exist"),
    ("checkpoint-empty-dir", lambda t, r: ["train", "--config", "tiny", f"checkpoint.load={_mkdir(t / 'empty')}"],
     "neither an ipuft checkpoint"),
    ("checkpoint-truncated", lambda t, r: ["eval", "--checkpoint", str(_damaged(t, r, "model.safetensors", _truncate)),
                                           "data.path=mnli-sample", *SAMPLE],
     "model.safetensors is damaged (its header needs"),
    ("checkpoint-corrupted", lambda t, r: ["export", "--checkpoint", str(_damaged(t, r, "model.safetensors", _flip)),
                                           "--hf", str(t / "out")], "model.safetensors does not match its checksum"),
    ("checkpoint-meta-garbage", lambda t, r: ["train", "--config", "tiny",
                                              f"checkpoint.load={_damaged(t, r, 'meta.json', _garbage)}"], "meta.json"),
    ("checkpoint-other-shape", lambda t, r: ["train", "--config", "tiny", "model.layers=3",
                                             "checkpoint.allow_changes=[model.layers,training.global_batch_size]",
                                             f"checkpoint.load={_checkpoint(t, r)}"], "lacks decoder.2"),
    ("resume-other-shape", lambda t, r: ["train", "--config", "tiny", "model.layers=3", "training.global_batch_size=2",
                                         f"checkpoint.load={_checkpoint(t, r)}"], "would change model.layers 2 -> 3;"),
    ("resume-other-batch", lambda t, r: ["train", "--config", "tiny", "training.steps=3",
                                         f"checkpoint.load={_checkpoint(t, r)}"], "would change training.global_batch_size 2 -> 16;"),
    ("resume-other-loss-scaling", lambda t, r: ["train", "--config", "tiny", "training.steps=3", "training.global_batch_size=2",
                                                "execution.loss_scaling=dynamic", f"checkpoint.load={_checkpoint(t, r)}"],
     "would change execution.loss_scaling 1.0 -> dynamic"),
    ("resume-unknown-optimizer", lambda t, r: ["train", "--config", "tiny", "training.steps=3", "training.global_batch_size=2",
                                             "training.optimizer.name=sgd", f"checkpoint.load={_checkpoint(t, r)}"],
     "unknown optimizer 'sgd'"),
    ("resume-without-optimizer-state", lambda t, r: ["train", "--config", "tiny", "training.steps=3", "training.global_batch_size=2",
                                                     f"checkpoint.load={_without_optim(t, r)}"], "the checkpoint has no optimizer state"),
    ("resume-other-precision", lambda t, r: ["train", "--config", "tiny", "training.steps=3", "training.global_batch_size=2",
                                             "model.precision=bfloat16", "training.stochastic_rounding=true",
                                             f"checkpoint.load={_checkpoint(t, r)}"], "would change model.precision float32 -> bfloat16"),
    ("checkpoint-no-manifest", lambda t, r: ["train", "--config", "tiny",
                                             f"checkpoint.load={_damaged(t, r, 'manifest.json', Path.unlink)}"],
     "has no manifest.json"),
    ("data-lone-surrogate", lambda t, r: ["train", "--config", "tiny", *SAMPLE, f"data.path={_lone_surrogate(t)}"],
     "surrogate.jsonl line 1: field 'premise' holds a lone UTF-16 surrogate ('\\ud800' at character 0)"),
    ("hf-no-config", lambda t, r: ["train", f"model.hf_checkpoint={_mkdir(t / 'hf')}"], "has no config.json"),
    ("hf-index-weight-map-list", lambda t, r: ["train", "data.path=null", f"model.hf_checkpoint={_hf_index(t, r, ['a.safetensors'])}"],
     "model.safetensors.index.json: weight_map must be a JSON object of tensor names to file names, found list"),
    ("hf-index-escapes", lambda t, r: ["train", "data.path=null", f"model.hf_checkpoint={_hf_index(t, r, {'x': '../model.safetensors'})}"],
     "weight_map['x'] must name a file in the checkpoint's directory, got '../model.safetensors'"),
    ("hf-other-model", lambda t, r: ["train", f"model.hf_checkpoint={_hf_other(t)}"],
     "has model_type 'bert'; the installed plugins read 'gemma2', 'gemma3_text', 'gptj', 'llama', 'mistral', 'olmo2', 'phi3', 'qwen2', 'qwen3'"),
    ("hf-llama-missing-keys", lambda t, r: ["train", f"model.hf_checkpoint={_hf_other(t, model_type='llama')}"],
     "llama/config.json: lacks hidden_size"),
    ("hf-llama-heads-not-dividing", lambda t, r: ["train", f"model.hf_checkpoint={_hf_other(t, **LLAMA_BAD_HEADS)}"],
     "num_attention_heads=5 does not divide hidden_size=64 and no head_dim is given"),
    ("hf-shape-mismatch", lambda t, r: ["train", "model.layers=4", f"model.hf_checkpoint={r / 'hf'}"],
     "model.layers=4 but the checkpoint has n_layer=2"),
    ("data-missing-file", lambda t, r: ["train", f"data.path={t}/missing.jsonl"], "does not exist"),
    ("data-template-field", lambda t, r: ["train", "--config", "tiny", *SAMPLE,
                                          f"data.path={_rows(t, 'd.jsonl', [MNLI, {'premise': 'x', 'label': 1}])}"],
     "row 2: template field 'hypothesis' is missing"),
    ("data-empty", lambda t, r: ["train", "--config", "tiny", *SAMPLE, f"data.path={_rows(t, 'e.jsonl', [])}"],
     "the dataset is empty"),
    ("data-row-too-long", lambda t, r: ["train", "--config", "tiny", *SAMPLE, "data.packing=false",
                                        f"data.path={_rows(t, 'l.jsonl', [MNLI, dict(MNLI, premise='word ' * 200)])}"],
     "row 2"),
    ("data-row-dict-for-text", lambda t, r: ["train", "--config", "tiny", *SAMPLE,
                                             f"data.path={_rows(t, 'dt.jsonl', [MNLI, dict(MNLI, premise={'a': 1})])}"],
     "row 2: template field 'premise' is dict ({'a': 1}), not text or an integer"),
    ("data-row-float-label", lambda t, r: ["train", "--config", "tiny", *SAMPLE,
                                           f"data.path={_rows(t, 'fl.jsonl', [MNLI, dict(MNLI, label=1.0)])}"],
     "row 2: template field 'label' is float (1.0), not text or an integer"),
    ("checkpoint-rng-state-garbage", lambda t, r: ["train", "--config", "tiny", "training.steps=3", "training.global_batch_size=2",
                                                   f"checkpoint.load={_forged_rng(t, r)}"], "must be the CPU generator's state"),
    ("data-bad-json", lambda t, r: ["train", "--config", "tiny", *SAMPLE,
                                    f"data.path={_rows(t, 'b.jsonl', [MNLI, '{not json'])}"], "line 2"),
    ("data-token-out-of-vocab", lambda t, r: ["train", "--config", "tiny", "data.format=tokens",
                                              f"data.path={_rows(t, 't.jsonl', [{'input_ids': [1] * 8 + [999]}])}"],
     "model.embedding.vocab_size"),
    ("data-unknown-suffix", lambda t, r: ["train", f"data.path={_write(t / 'd.xml', '<rows/>')}"], ".xml"),
    ("output-dir-holds-a-run", lambda t, r: ["train", "--config", "tiny", f"output_dir={_checkpoint(t, r).parent.parent}"],
     "already holds a run"),
    # Security: a checkpoint or Hugging Face directory is untrusted data.
    ("sec-checkpoint-interpolation", lambda t, r: ["train", "--checkpoint", str(_forged_config(t, r, {
        "model": {"seed": "${oc.env:IPUFT_TEST_SECRET}"}}))], "holds an interpolation"),
    ("sec-checkpoint-interpolation-nested", lambda t, r: ["eval", "--checkpoint", str(_forged_config(t, r, {
        "data": {"template": "{premise} ${oc.env:IPUFT_TEST_SECRET}"}}))], "data.template holds an interpolation"),
    ("sec-hf-config-interpolation", lambda t, r: ["train", f"model.hf_checkpoint={_hf_config(t, r, n_layer='${oc.env:IPUFT_TEST_SECRET}')}"],
     "n_layer must be a positive integer"),
    ("sec-hf-config-wrong-type", lambda t, r: ["train", f"model.hf_checkpoint={_hf_config(t, r, n_embd=[64])}"],
     "n_embd must be a positive integer"),
    ("sec-manifest-parent-path", lambda t, r: ["train", "--config", "tiny", f"checkpoint.load={_forged_manifest(t, r, {'../../victim/secret.txt': 'a' * 64})}"],
     "which is not a file of the checkpoint format"),
    ("sec-manifest-absolute-path", lambda t, r: ["export", "--checkpoint", str(_forged_manifest(t, r, {'/proc/self/mem': 'a' * 64})),
                                                 "--hf", str(t / "out")], "which is not a file of the checkpoint format"),
    ("sec-manifest-symlink", lambda t, r: ["train", "--config", "tiny", f"checkpoint.load={_linked(t, r)}"],
     "model.safetensors, listed in its manifest, is a link"),
    ("sec-manifest-empty", lambda t, r: ["train", "--config", "tiny", f"checkpoint.load={_forged_manifest(t, r, {}, keep=False)}"],
     "does not list model.safetensors"),
    ("sec-manifest-omits-corrupted-weights", lambda t, r: ["eval", "--checkpoint", str(_unlisted_corruption(t, r, "model.safetensors")),
                                                           "data.path=mnli-sample", *SAMPLE], "does not list model.safetensors"),
    ("sec-manifest-omits-corrupted-optim", lambda t, r: ["train", "--config", "tiny", "training.steps=3",
                                                         f"checkpoint.load={_unlisted_corruption(t, r, 'optim.safetensors')}"],
     "holds optim.safetensors, not listed in its manifest.json"),
    ("sec-output-dir-holds-another-run", lambda t, r: ["train", "--config", "tiny", "training.steps=2", "training.global_batch_size=2",
                                                       f"checkpoint.load={_checkpoint(t, r)}", f"output_dir={_victim(t)}"],
     "checkpoint.load is not one of its checkpoints"),
    ("checkpoint-meta-negative-step", lambda t, r: ["train", "--config", "tiny", "training.steps=3",
                                                    f"checkpoint.load={_forged_meta(t, r, step=-5)}"], "step must be an integer"),
    ("checkpoint-meta-huge-step", lambda t, r: ["train", "--config", "tiny", "training.steps=3",
                                                f"checkpoint.load={_forged_meta(t, r, step=1e30)}"], "step must be an integer"),
    ("checkpoint-nothing-to-do", lambda t, r: ["train", "--config", "tiny", "training.steps=1",
                                               f"checkpoint.load={_checkpoint(t, r)}"], "nothing to train"),
    # Values: non-finite, non-positive where that makes no sense, and absurd sizes (answered at once).
    ("value-infinite-lr", lambda t, r: ["train", "training.optimizer.learning_rate.maximum=inf"], "must be finite, got inf"),
    ("value-nan-weight-decay", lambda t, r: ["train", "plugins.adamw.weight_decay=nan"], "plugins.adamw.weight_decay"),
    ("value-infinite-loss-scale", lambda t, r: ["train", "execution.loss_scaling=.inf"], "must be a finite number > 0"),
    ("value-zero-layer-norm-eps", lambda t, r: ["train", "model.layer_norm_epsilon=0"], "model.layer_norm_epsilon: must be > 0"),
    ("value-zero-rotary-base", lambda t, r: ["train", "model.attention.rotary_positional_embeddings_base=0"],
     "rotary_positional_embeddings_base: must be > 0"),
    ("value-absurd-layers", lambda t, r: ["plan", "model.layers=10000000000000000000000"], "model.layers: 10000000000000000000000 is beyond any real run"),
    ("value-absurd-hidden", lambda t, r: ["plan", "model.hidden_size=1099511627776"], "model.hidden_size: 1099511627776 is beyond"),
    ("value-absurd-batch", lambda t, r: ["train", "training.global_batch_size=1000000000000"], "training.global_batch_size: 1000000000000 is beyond"),
    ("value-yaml-alias-bomb", lambda t, r: ["train", "--config", str(_write(t / "bomb.yaml", _alias_bomb()))], "YAML aliases"),
    # The environment: paths of the wrong kind, unreadable or non-UTF-8 data, deep or huge rows, binary presets.
    ("env-output-dir-is-a-file", lambda t, r: ["train", "--config", "tiny", f"output_dir={_write(t / 'afile', 'x')}"],
     "exists and is not a directory"),
    ("env-output-dir-in-proc", lambda t, r: ["train", "--config", "tiny", "output_dir=/proc/ipuft-run"], "output_dir: /proc/ipuft-run cannot be written"),
    ("env-checkpoint-save-under-a-file", lambda t, r: ["train", "--config", "tiny", f"checkpoint.save={_write(t / 'f', 'x')}/ck"],
     "cannot be created"),
    ("env-data-not-utf8", lambda t, r: ["train", "--config", "tiny", *SAMPLE, f"data.path={_write_bytes(t / 'b.jsonl', b'{}' + bytes([255, 254]) + b'')}"],
     "not UTF-8 text"),
    ("env-data-lone-surrogate", lambda t, r: ["train", "--config", "tiny", *SAMPLE,
                                              f"data.path={_write_bytes(t / 's.csv', b'premise,hypothesis,label' + bytes([10, 0xed, 0xa0, 0x80]) + b',b,0')}"],
     "not UTF-8 text"),
    ("env-data-deep-json", lambda t, r: ["train", "--config", "tiny", *SAMPLE, f"data.path={_write(t / 'd.jsonl', '[' * 100000 + ']' * 100000)}"],
     "nests too deeply"),
    ("env-data-huge-row", lambda t, r: ["train", "--config", "tiny", *SAMPLE,
                                        f"data.path={_write(t / 'h.jsonl', json.dumps(dict(MNLI, premise='a' * (1 << 24))))}"],
     "longer than 16,777,216 characters"),
    ("env-data-huge-csv-field", lambda t, r: ["train", "--config", "tiny", *SAMPLE,
                                              f"data.path={_write(t / 'h.csv', 'premise,hypothesis,label' + chr(10) + 'a' * 200000 + ',b,0')}"],
     "not a valid CSV file"),
    ("env-data-is-a-directory", lambda t, r: ["train", "--config", "tiny", *SAMPLE, f"data.path={_mkdir(t / 'dir.jsonl')}"],
     "is not a regular file"),
    ("env-binary-preset", lambda t, r: ["train", "--config", str(_write_bytes(t / "bin.yaml", bytes(range(256)) * 4))],
     "cannot be read as UTF-8 text"),
    ("export-into-a-file", lambda t, r: ["export", "--checkpoint", str(_checkpoint(t, r)), "--hf", str(_write(t / "file", "mine"))],
     "exists and is not an empty directory"),
    ("export-into-proc", lambda t, r: ["export", "--checkpoint", str(_checkpoint(t, r)), "--hf", "/proc/ipuft-export"],
     "cannot be written"),
    ("eval-checkpoint-without-data", lambda t, r: ["eval", "--checkpoint", str(_checkpoint(t, r))],
     "eval: give data.path=FILE, the data to evaluate on"),
    ("generate-bad-override", lambda t, r: ["generate", "--checkpoint", str(_checkpoint(t, r)), "hello", "model.layerz=1"],
     "unknown config key model.layerz"),
    ("config-and-checkpoint", lambda t, r: ["train", "--config", "tiny", "--checkpoint", str(_checkpoint(t, r))],
     "a checkpoint's config is the preset; give one of the two"),
    ("export-not-empty", lambda t, r: ["export", "--checkpoint", str(_checkpoint(t, r)),
                                       "--hf", str(_write(t / "full" / "x", "mine").parent)], "exists and is not an empty directory"),
]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _write_bytes(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _alias_bomb() -> str:
    """A "billion laughs": nine levels of nine aliases each, a billion leaves once expanded."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    return "model:\n  layers: 2\n" + "\n".join(lines) + "\n"


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _garbage(path: Path) -> None:
    path.write_text("{ not json")


def _damaged(tmp, trained, name, damage):
    checkpoint = _checkpoint(tmp, trained)
    damage(checkpoint / name)
    return checkpoint


def _hf_other(tmp, **config):
    config = config or {"model_type": "bert"}
    return _write(tmp / config["model_type"] / "config.json", json.dumps(config)).parent


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _reseal(checkpoint: Path, manifest: dict | None = None) -> Path:
    """Rewrite the manifest so that it matches the files again, as a forger would."""
    manifest = manifest if manifest is not None else {p.name: _sha(p) for p in sorted(checkpoint.iterdir())
                                                      if p.name != "manifest.json"}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    return checkpoint


def _forged_config(tmp, trained, changes: dict) -> Path:
    import yaml

    checkpoint = _checkpoint(tmp, trained)
    config = yaml.safe_load((checkpoint / "config.yaml").read_text())
    for section, values in changes.items():
        config.setdefault(section, {}).update(values)
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(config))
    return _reseal(checkpoint)


def _forged_meta(tmp, trained, **changes) -> Path:
    checkpoint = _checkpoint(tmp, trained)
    meta = json.loads((checkpoint / "meta.json").read_text())
    (checkpoint / "meta.json").write_text(json.dumps({**meta, **changes}))
    return _reseal(checkpoint)


def _forged_manifest(tmp, trained, extra: dict, keep: bool = True) -> Path:
    checkpoint = _checkpoint(tmp, trained)
    manifest = json.loads((checkpoint / "manifest.json").read_text()) if keep else {}
    return _reseal(checkpoint, {**manifest, **extra})


def _forged_rng(tmp, trained) -> Path:
    import torch
    from safetensors.torch import save_file

    checkpoint = _checkpoint(tmp, trained)
    save_file({"torch": torch.zeros(3, dtype=torch.float32)}, str(checkpoint / "state.safetensors"))
    return _reseal(checkpoint)


def _without_optim(tmp, trained) -> Path:
    checkpoint = _checkpoint(tmp, trained)
    (checkpoint / "optim.safetensors").unlink()
    meta = json.loads((checkpoint / "meta.json").read_text())
    (checkpoint / "meta.json").write_text(json.dumps({**meta, "optim_state": False}))
    return _reseal(checkpoint)


def _linked(tmp, trained) -> Path:
    checkpoint = _checkpoint(tmp, trained)
    outside = tmp / "outside.safetensors"
    shutil.move(checkpoint / "model.safetensors", outside)
    (checkpoint / "model.safetensors").symlink_to(outside)
    return checkpoint


def _unlisted_corruption(tmp, trained, name: str) -> Path:
    checkpoint = _checkpoint(tmp, trained)
    _flip(checkpoint / name)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest[name]
    return _reseal(checkpoint, manifest)


def _lone_surrogate(tmp) -> Path:
    """A JSONL row whose text is JSON's escape of half a UTF-16 surrogate pair: valid JSON, not Unicode text."""
    return _write(tmp / "surrogate.jsonl", '{"premise": "\\ud800", "hypothesis": "x", "label": 0}\n')


def _hf_index(tmp, trained, weight_map) -> Path:
    """A copy of the Hugging Face directory with a sharded checkpoint's index beside its weights."""
    hf = tmp / "hf-indexed"
    shutil.copytree(trained / "hf", hf)
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return hf


def _hf_config(tmp, trained, **changes) -> Path:
    hf = tmp / "hf-forged"
    shutil.copytree(trained / "hf", hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, **changes}))
    return hf


def _victim(tmp) -> Path:
    """Another run's directory, which no case may change."""
    victim = tmp / "victim"
    _write(victim / "metrics.jsonl", '{"step": 1, "loss": 1.0}\n')
    _write(victim / "config.yaml", "theirs: true\n")
    return victim


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize(("args", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(tmp_path, trained, capsys, monkeypatch, args, fragment):
    assert_one_clear_line(tmp_path, trained, capsys, monkeypatch, args, fragment)


def assert_one_clear_line(tmp_path, trained, capsys, monkeypatch, args, fragment) -> int:
    """``ipuft ARGS`` (``args(tmp_path, trained)``) fails with one line holding ``fragment``, no traceback, and
    changes nothing under ``tmp_path``; returns its exit code."""
    monkeypatch.chdir(tmp_path)
    argv = args(tmp_path, trained)
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(argv)
    _, err = capsys.readouterr()
    err = without_recipe(err)
    assert info.value.code not in (0, None)
    assert err.count("\n") == 1 and err.startswith("ipuft: error: "), err
    assert fragment in err, err
    assert "Traceback" not in err
    assert snapshot(tmp_path) == before  # nothing written, nothing damaged
    return info.value.code


def test_checkpoint_config_never_chooses_where_a_run_writes(tmp_path, trained, monkeypatch):
    """A checkpoint whose config names another run's directory (and checkpoint root) as its output: training
    from it writes a new run of its own, and the other run is untouched."""
    monkeypatch.chdir(tmp_path)
    victim = _victim(tmp_path)
    forged = _forged_config(tmp_path, trained, {"checkpoint": {"save": str(victim / "checkpoints")}})
    config = (forged / "config.yaml").read_text() + f"output_dir: {victim}\n"
    (forged / "config.yaml").write_text(config.replace("output_dir: null\n", ""))
    _reseal(forged)
    before = snapshot(victim)
    main(["train", "--checkpoint", str(forged), "training.steps=2"])
    assert snapshot(victim) == before
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and (runs[0] / "metrics.jsonl").exists()
    assert [p.name for p in (runs[0] / "checkpoints").iterdir()] == ["step-00000002"]


def test_interpolation_in_a_checkpoint_is_never_resolved(tmp_path, trained, monkeypatch, capsys):
    monkeypatch.setenv("IPUFT_TEST_SECRET", "hunter2")
    monkeypatch.chdir(tmp_path)
    forged = _forged_config(tmp_path, trained, {"data": {"template": "${oc.env:IPUFT_TEST_SECRET}"}})
    with pytest.raises(SystemExit) as info:
        main(["config", "show", "--checkpoint", str(forged)])
    out, err = capsys.readouterr()
    assert info.value.code == 2
    assert "hunter2" not in out + err and "holds an interpolation" in err


def test_plugin_that_raises_on_import(fake_dist, capsys):
    fake_dist("ipuft-bad-import", {"bad_import": "bad_import_plugin"},
              {"bad_import_plugin": "raise ImportError('needs libfoo')\n"})
    with pytest.raises(SystemExit) as info:
        main(["train"])
    _, err = capsys.readouterr()
    assert info.value.code == 2
    assert err == ("ipuft: error: plugin 'bad_import' (distribution ipuft-bad-import 0.1.0) failed to import: "
                   "ImportError: needs libfoo; fix or uninstall it, or set IPUFT_DISABLE_PLUGINS=bad_import "
                   "(IPUFT_DEBUG=1 shows the traceback)\n")


def test_corpus_is_large_enough():
    assert len(CASES) + 1 >= 25
    classes = ("sec-", "value-", "env-", "resume-", "checkpoint-meta-", "export-")
    for prefix in classes:
        assert sum(c[0].startswith(prefix) for c in CASES) >= 2, prefix
