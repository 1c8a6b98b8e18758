"""Config: presets, merge order, derived values and the one-line errors of bad input."""

from pathlib import Path

import pytest
from omegaconf.errors import ReadonlyConfigError

from ipuft.config import load_config, preset_names
from ipuft.config.rules import check_plugins
from ipuft.errors import ConfigError


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_validates(hooks, preset):
    cfg = load_config(preset, [], hooks.registrations.config_sections)
    check_plugins(cfg, hooks.registrations)
    assert cfg.gradient_accumulation * cfg.execution.data_parallel * cfg.execution.micro_batch_size == \
        cfg.training.global_batch_size


def test_presets_shipped():
    assert {"tiny", "small-cpu", "gptj-6b"} <= set(preset_names())


def test_tiny_is_the_references(make_config):
    m = make_config().model
    assert (m.sequence_length, m.embedding.vocab_size, m.hidden_size, m.layers, m.attention.heads,
            m.attention.rotary_dim) == (8, 128, 64, 2, 4, 16)


def test_gptj_6b_preset(make_config):
    cfg = make_config(preset="gptj-6b")
    m, t, e = cfg.model, cfg.training, cfg.execution
    assert (m.layers, m.hidden_size, m.attention.heads, m.attention.rotary_dim, m.embedding.vocab_size,
            m.sequence_length, m.intermediate_size) == (28, 4096, 16, 64, 50400, 1024, 16384)
    assert (t.global_batch_size, t.steps, t.optimizer.learning_rate.maximum,
            t.optimizer.learning_rate.warmup_proportion, cfg.plugins.adamw.weight_decay) == (128, 500, 5e-6, 0.005995, 0.0)
    assert (e.loss_scaling, e.micro_batch_size) == (4096, 1)
    assert cfg.gradient_accumulation == 128


def test_merge_order_schema_then_preset_then_overrides(make_config):
    assert make_config().plugins.adamw.beta1 == 0.9  # schema default survives the preset
    assert make_config().model.hidden_size == 64  # preset beats schema
    assert make_config("model.hidden_size=128").model.hidden_size == 128  # override beats preset


def test_derived_values(make_config):
    cfg = make_config("training.global_batch_size=24", "execution.micro_batch_size=3")
    assert cfg.gradient_accumulation == 8
    assert cfg.model.intermediate_size == 4 * cfg.model.hidden_size
    assert cfg.execution.rts is False


def test_resolved_config_is_read_only(make_config):
    cfg = make_config()
    with pytest.raises(ReadonlyConfigError):
        cfg.model.layers = 3


def test_plugin_section_is_typed(make_config):
    assert make_config("plugins.gptj_decoder.attention_kernel=eager").plugins.gptj_decoder.attention_kernel.value == "eager"


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["model.layer=3"], "unknown config key model.layer; valid keys in model: layers"),
        (["nonsense=1"], "unknown config key nonsense; valid keys at the top level: model"),
        (["plugins.gptj_decoder.kernel=sdpa"], "unknown config key plugins.gptj_decoder.kernel; valid keys in plugins.gptj_decoder: attention_kernel"),
        (["plugins.gptj_decoder.attention_kernel=flash"], "plugins.gptj_decoder.attention_kernel: Invalid value 'flash', expected one of [sdpa, eager]"),
        (["model.layers=two"], "model.layers: Value 'two' of type 'str' could not be converted to Integer"),
        (["execution.offload=maybe"], "execution.offload:"),
        (["layers"], "argument 'layers' is not KEY=VALUE"),
        (["training.global_batch_size=10", "execution.micro_batch_size=4"], "training.global_batch_size: 10 is not divisible"),
        (["model.attention.rotary_dim=17"], "model.attention.rotary_dim: must be even"),
        (["gradient_accumulation=4"], "gradient_accumulation: is derived"),
        (["model.layers=0"], "model.layers: must be > 0"),
        (["model.precision=float8"], "model.precision: Invalid value 'float8', expected one of [float32, float16, bfloat16]"),
        (["model.precision=bfloat16", "training.stochastic_rounding=true", "training.master_weights=true"],
         "training.stochastic_rounding: and training.master_weights are two ways to update 16-bit weights; set at most one"),
        (["training.stochastic_rounding=true"], "training.stochastic_rounding: applies to 16-bit weights, but model.precision is float32"),
        (["training.master_weights=true"], "training.master_weights: applies to 16-bit weights"),
        (["execution.tensor_parallel=3"], "model.attention.heads: 4 is not divisible by execution.tensor_parallel=3"),
        (["training.optimizer.learning_rate.schedule=step"], "expected one of [constant, linear, cosine]"),
        (["execution.optimizer_placement=gpu"], "execution.optimizer_placement: Invalid value 'gpu', expected one of [device, host]"),
        (["execution.optimizer_placement=host", "execution.offload=false"],
         "execution.optimizer_placement: host updates the variables where execution.offload=true keeps them"),
    ],
)
def test_bad_config_is_one_clear_line(hooks, overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", overrides, hooks.registrations.config_sections)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_unknown_preset_lists_presets(hooks):
    with pytest.raises(ConfigError, match=r"unknown preset 'huge'; presets: finetune, gemma3-12b, gptj-6b, llama3-8b, mistral-7b, phi4, qwen3-8b, small-cpu, tiny"):
        load_config("huge", [], hooks.registrations.config_sections)


def test_preset_file_by_path(hooks, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("model:\n  layers: 3\n  hidden_size: 32\n  attention:\n    heads: 2\n    rotary_dim: 8\n")
    assert load_config(str(path), [], hooks.registrations.config_sections).model.layers == 3
    path.write_text("model:\n  layerz: 3\n")
    with pytest.raises(ConfigError, match=r"preset .*mine.yaml: unknown config key model.layerz"):
        load_config(str(path), [], hooks.registrations.config_sections)


def test_a_yaml_starts_from_a_base_preset_or_file(hooks, tmp_path):
    """``base:``: a shipped preset or a file beside (or below) the YAML naming it, merged under it mapping by
    mapping, lists replaced; a chain of bases resolves from the bottom."""
    sections = hooks.registrations.config_sections
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "common.yaml").write_text(
        "base: tiny\ntraining:\n  steps: 7\n  optimizer:\n    learning_rate:\n      maximum: 0.5\n"
        "model:\n  freeze: [head, embeddings]\n")
    mine = tmp_path / "mine.yaml"
    mine.write_text("base: shared/common.yaml\ntraining:\n  optimizer:\n    learning_rate:\n      schedule: linear\n"
                    "model:\n  freeze: [head]\n")
    cfg = load_config(str(mine), ["training.global_batch_size=4"], sections)
    lr = cfg.training.optimizer.learning_rate
    assert (cfg.training.steps, lr.maximum, lr.schedule.value, list(cfg.model.freeze)) == (7, 0.5, "linear", ["head"])
    assert (cfg.model.hidden_size, cfg.model.sequence_length, cfg.training.global_batch_size) == (64, 8, 4)  # tiny's


@pytest.mark.parametrize(("files", "message"), [
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"}, r"the bases make a cycle \(.*a\.yaml -> .*b\.yaml -> "
                                                                 r".*a\.yaml\); remove one$"),
    ({"a.yaml": "base: a.yaml\n"}, r"the bases make a cycle"),
    ({f"{i}.yaml": f"base: {i + 1}.yaml\n" for i in range(12)}, r"more than 8 presets start from one another"),
    ({"a.yaml": "base: /etc/ipuft.yaml\n"}, r"a base is a preset name or a path relative to .*, not an absolute path$"),
    ({"a.yaml": "base: ../outside.yaml\n"}, r"the base leaves .*, the directory of the file naming it"),
    ({"a.yaml": "base: [tiny]\n"}, r"base must name a preset \(finetune, gemma3-12b, gptj-6b, .*\) or a \.yaml file, got "),
    ({"a.yaml": "base: missing.yaml\n"}, r"base missing\.yaml: preset file .*missing\.yaml does not exist$"),
    ({"a.yaml": "base: nope\n"}, r"base nope: unknown preset 'nope'; presets: finetune, "),
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "model:\n  layerz: 2\n"}, r"unknown config key model\.layerz"),
    # Without a .yaml suffix a base is a preset's name, never a path joined to the presets' directory.
    ({"a.yaml": "base: /etc/hostname\n"}, r"base /etc/hostname: unknown preset '/etc/hostname'; presets: finetune, "
                                          r".* \(or a \.yaml file inside .*configs\)$"),
    ({"a.yaml": "base: ../outside\n"}, r"base \.\./outside: unknown preset '\.\./outside'; .*inside .*configs\)$"),
    ({"a.yaml": "base: ../../../../../../../../etc/hostname\n"}, r"unknown preset '\.\./\.\./"),
    ({"a.yaml": "base: b\n", "b.yaml": "training:\n  steps: 3\n"}, r"base b: unknown preset 'b'"),
], ids=["cycle", "self", "depth", "absolute", "escapes", "not-a-name", "missing-file", "unknown-preset", "bad-key",
        "absolute-no-suffix", "escapes-no-suffix", "preset-dir-escape", "file-no-suffix"])
def test_a_bad_base_is_one_line(hooks, tmp_path, files, message):
    root = tmp_path / "configs"
    root.mkdir()
    (tmp_path / "outside.yaml").write_text("training:\n  steps: 3\n")
    for name, text in files.items():
        (root / name).write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(str(root / next(iter(files))), [], hooks.registrations.config_sections)
    assert "\n" not in str(info.value)


def test_a_base_that_links_out_of_its_directory_is_refused(hooks, tmp_path):
    (tmp_path / "outside.yaml").write_text("training:\n  steps: 3\n")
    root = tmp_path / "configs"
    root.mkdir()
    (root / "link.yaml").symlink_to(tmp_path / "outside.yaml")
    (root / "a.yaml").write_text("base: link.yaml\n")
    with pytest.raises(ConfigError, match=r"base link\.yaml: the base leaves .*configs, the directory of the file"):
        load_config(str(root / "a.yaml"), [], hooks.registrations.config_sections)


def test_a_checkpoint_saved_with_retired_or_moved_keys_still_loads(hooks, trained, tmp_path):
    """``model.eval`` (never read) was removed and Adam's keys moved to ``plugins.adamw``: a checkpoint whose
    config.yaml still has them loads, without the first and with the second in its new place."""
    import hashlib
    import json
    import shutil

    from ipuft.config import checkpoint_config
    from ipuft.io.checkpoint import find_checkpoint

    old = tmp_path / "old"
    shutil.copytree(find_checkpoint(trained / "run"), old)
    import yaml

    data = yaml.safe_load((old / "config.yaml").read_text())
    data["model"]["eval"] = False
    data["plugins"].pop("adamw")  # as a config of before the move
    data["training"]["optimizer"]["beta2"] = 0.95
    config = yaml.safe_dump(data)
    (old / "config.yaml").write_text(config)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["config.yaml"] = hashlib.sha256(config.encode()).hexdigest()
    (old / "manifest.json").write_text(json.dumps(manifest))
    cfg = checkpoint_config(old, hooks.registrations.config_sections)
    assert "eval" not in cfg.model and cfg.checkpoint.load == str(old)
    assert cfg.plugins.adamw.beta2 == 0.95 and "beta2" not in cfg.training.optimizer
    with pytest.raises(ConfigError, match=r"model\.eval"):
        load_config("tiny", ["model.eval=false"], hooks.registrations.config_sections)


def test_a_checkpoint_config_whose_plugins_node_is_not_a_mapping_is_one_line(hooks, trained, tmp_path):
    """An old-style Adam key to move, and a ``plugins`` node that is not a mapping to move it into: the
    migration leaves it, and loading says what is wrong in one line."""
    import hashlib
    import json
    import shutil

    import yaml

    from ipuft.config import checkpoint_config
    from ipuft.io.checkpoint import find_checkpoint

    forged = tmp_path / "forged"
    shutil.copytree(find_checkpoint(trained / "run"), forged)
    data = yaml.safe_load((forged / "config.yaml").read_text())
    data["plugins"], data["training"]["optimizer"]["beta2"] = "oops", 0.95
    config = yaml.safe_dump(data)
    (forged / "config.yaml").write_text(config)
    manifest = json.loads((forged / "manifest.json").read_text())
    manifest["config.yaml"] = hashlib.sha256(config.encode()).hexdigest()
    (forged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError) as info:
        checkpoint_config(forged, hooks.registrations.config_sections)
    assert str(info.value) == (f"preset {forged / 'config.yaml'}: config: Merge error: str is not a subclass of "
                               f"PluginSections. value: oops")


def test_a_runs_config_yaml_loads_back_as_the_same_config(hooks, tmp_path):
    """What `ipuft config show` prints (and a run directory's config.yaml holds) is a --config file: its
    derived gradient_accumulation is a record, re-derived after the overrides; a value that is not what its
    batch keys give is refused with both numbers."""
    from ipuft.config import to_yaml

    sections = hooks.registrations.config_sections
    cfg = load_config("tiny", ["training.global_batch_size=8", "execution.micro_batch_size=2"], sections)
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(cfg))
    assert load_config(str(saved), [], sections) == cfg
    assert load_config(str(saved), ["training.global_batch_size=16"], sections).gradient_accumulation == 8
    saved.write_text(to_yaml(cfg).replace("gradient_accumulation: 4", "gradient_accumulation: 2"))
    with pytest.raises(ConfigError, match=r"^gradient_accumulation: is derived as .* = 4 here, not 2; set those"):
        load_config(str(saved), [], sections)


def test_a_saved_config_of_an_unselected_plugin_loads_but_a_setting_of_it_is_refused(install_plugin, tmp_path):
    """A config dump holds every installed plugin's section at its defaults, used or not: those set nothing.
    A value other than the default in a section the config does not use is still the one-line error."""
    from ipuft.config import to_yaml

    hooks = install_plugin("ipuft_test_sgd", name="sgd", path=Path(__file__).parent / "fixtures")
    sections = hooks.registrations.config_sections
    cfg = load_config("tiny", [], sections)  # adamw: plugins.sgd does nothing here
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(cfg))
    assert "momentum: 0.9" in saved.read_text()
    assert load_config(str(saved), [], sections) == cfg
    saved.write_text(to_yaml(cfg).replace("momentum: 0.9", "momentum: 0.5"))
    with pytest.raises(ConfigError, match=r"^plugins\.sgd\.momentum \(used when training\.optimizer\.name=sgd\): "
                                          r"it is set but does nothing"):
        load_config(str(saved), [], sections)
