"""Hostile values on the Llama family's surfaces: token ids outside the vocabulary (config.json's, the config's, a
tokenizer's), generate's sampling options and length, rope scaling and head options that cannot run, each one
line, exit 2, nothing changed on disk; and what transformers 5 computes where config.json is unusual (its rope
precedence, a Mistral without sliding_window, a head_dim that is not hidden / heads), matched number for number."""

import json
import shutil

import pytest
import torch
from llama_reference import SHAPE, save_hf, tokenizer_json
from test_bad_input import LLAMA, _checkpoint, _hf_other, _rows, _write, assert_one_clear_line
from test_llama import match_transformers

from ipuft.config import load_config
from ipuft_llama.family import read_config


def _tokenizer_dir(tmp, vocab_size=101, eos=None):
    """A word-level tokenizer (``<unk>``, ``<s>``, ``</s>``, ``w3``...) in a directory, with a tokenizer_config.json
    naming ``eos`` its eos_token when given."""
    directory = tmp / f"tok-{vocab_size}-{eos}"
    directory.mkdir()
    tokenizer_json(directory / "tokenizer.json", vocab_size)
    if eos is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return directory


def _generate(t, r, *args):
    return ["generate", "--checkpoint", str(_checkpoint(t, r)), *args]


TEXT = {"text": "w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"}
# A small Llama from scratch (the llama3-8b preset's components and options, tiny shapes).
PLAN_LLAMA = ["plan", "--config", "llama3-8b", "model.layers=2", "model.hidden_size=64", "model.intermediate_size=96",
              "model.attention.heads=4", "model.attention.rotary_dim=16", "model.embedding.vocab_size=128",
              "model.bos_token_id=1", "model.eos_token_ids=[2]", "model.sequence_length=16", "plugins.llama.kv_heads=2",
              "training.global_batch_size=1"]

GPTJ = {"model_type": "gptj", "n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8, "vocab_size": 128,
        "n_positions": 128}


def _with_source(tmp, trained, **fields):
    """A copy of the trained run's checkpoint carrying a source config.json (hf_config.json) of its model, with
    ``fields`` over it, resealed as a forger would."""
    from test_bad_input import _reseal

    checkpoint = _checkpoint(tmp, trained)
    (checkpoint / "hf_config.json").write_text(json.dumps({**GPTJ, "n_inner": 256, **fields}))
    return _reseal(checkpoint)


# (id, setup(tmp, trained) -> CLI arguments, a fragment the one-line message must contain)
CASES = [
    # Token ids: where each is set, checked against the vocabulary.
    ("ids-hf-bos-past-vocab", lambda t, r: ["train", f"model.hf_checkpoint={_hf_other(t, **LLAMA, bos_token_id=128)}"],
     "bos_token_id=128 is outside the vocabulary (vocab_size=128: ids 0 to 127)"),
    ("ids-hf-eos-negative", lambda t, r: ["train", f"model.hf_checkpoint={_hf_other(t, **LLAMA, eos_token_id=[2, -1])}"],
     "eos_token_id must be a non-negative integer, got -1"),
    ("ids-config-bos-past-vocab", lambda t, r: ["train", "--config", "tiny", "model.bos_token_id=999"],
     "model.bos_token_id: token id 999 is outside the vocabulary (0 to 127: model.embedding.vocab_size=128)"),
    ("ids-config-eos-negative", lambda t, r: ["train", "--config", "tiny", "model.eos_token_ids=[2,-3]"],
     "model.eos_token_ids: token id -3 is outside the vocabulary"),
    ("ids-tokenizer-eos-past-vocab", lambda t, r: [
        "train", "--config", "tiny", f"data.tokenizer={_tokenizer_dir(t, eos='w80')}", "model.embedding.vocab_size=64",
        "data.format=text", f"data.path={_rows(t, 'text.jsonl', [TEXT] * 4)}"],
     "data.tokenizer: tokenizer_config.json's eos_token 'w80': token id 80 is outside the model's vocabulary (0 to 63"),
    ("ids-prompt-past-vocab", lambda t, r: _generate(t, r, "w3 w200", f"data.tokenizer={_tokenizer_dir(t, 300)}"),
     "prompt 1: token id 200 is outside the model's vocabulary (0 to 127"),
    # generate's options: finite and in range, and a length within the model's positions.
    ("generate-nan-temperature", lambda t, r: _generate(t, r, "--temperature", "nan", "w3"),
     "temperature: must be 0 (greedy) or a number in [0.001, 1000], got nan"),
    ("generate-tiny-temperature", lambda t, r: _generate(t, r, "--temperature", "1e-30", "w3"),
     "temperature: must be 0 (greedy) or a number in [0.001, 1000], got 1e-30"),
    ("generate-nan-top-p", lambda t, r: _generate(t, r, "--top-p", "nan", "w3"), "top_p: must be a number in (0, 1]"),
    ("generate-huge-seed", lambda t, r: _generate(t, r, "--seed", str(1 << 64), "w3"),
     "seed: must be a whole number in [0, 2**64), got 18446744073709551616"),
    ("generate-past-positions", lambda t, r: _generate(t, r, "--max-new-tokens", "7", "w3 w4",
                                                       f"data.tokenizer={_tokenizer_dir(t)}"),
     "prompt 1: its 2 tokens and max_new_tokens=7 pass the model's 8 positions (model.sequence_length)"),
    # Rope scaling and head options that cannot run.
    ("rope-hf-zero-factor", lambda t, r: ["train", f"model.hf_checkpoint={_hf_other(t, **LLAMA, rope_parameters={'rope_type': 'linear', 'factor': 0})}"],
     "rope_parameters's factor must be a number in (0, 10000), got 0"),
    ("rope-hf-absurd-factor", lambda t, r: ["train", f"model.hf_checkpoint={_hf_other(t, **LLAMA, rope_scaling={'rope_type': 'linear', 'factor': 1e9})}"],
     "rope_scaling's factor must be a number in (0, 10000), got 1000000000.0"),
    ("rope-config-zero-factor", lambda t, r: [*PLAN_LLAMA, "plugins.llama.rope_scaling={rope_type: linear, factor: 0}"],
     "plugins.llama.rope_scaling.factor: must be a number in (0, 10000] (real ones are 2 to 64), got 0.0"),
    ("rope-config-nan-factor", lambda t, r: [*PLAN_LLAMA, "plugins.llama.rope_scaling={rope_type: llama3, factor: .nan}"],
     "plugins.llama.rope_scaling.factor: must be a number in (0, 10000]"),
    ("heads-zero-kv-heads", lambda t, r: [*PLAN_LLAMA, "plugins.llama.kv_heads=0"],
     "plugins.llama.kv_heads: must be a positive integer of at most 65536 (null: as many as model.attention.heads), got 0"),
    ("heads-zero-head-dim", lambda t, r: [*PLAN_LLAMA, "plugins.llama.head_dim=0"],
     "plugins.llama.head_dim: must be a positive integer of at most 65536 (null: hidden_size / heads), got 0"),
    # GPT-J's head rules stay GPT-J's.
    ("heads-gptj-not-dividing", lambda t, r: ["plan", "--config", "tiny", "model.attention.heads=5"],
     "model.hidden_size: 64 is not divisible by model.attention.heads=5"),
    ("heads-gptj-rotary-past-head", lambda t, r: ["plan", "--config", "tiny", "model.attention.rotary_dim=32"],
     "model.attention.rotary_dim: must be at most the head size 16"),
    # Every config.json field an export writes back is checked when read, whether the family reads it or not.
    ("field-llama-positions-text", lambda t, r: ["train", f"model.hf_checkpoint={_hf_other(t, **{**LLAMA, 'max_position_embeddings': 'lots'})}"],
     "config.json: max_position_embeddings must be a positive integer, got the string 'lots'"),
    ("field-gptj-unread-positions", lambda t, r: ["train", f"model.hf_checkpoint={_hf_other(t, **GPTJ, max_position_embeddings=0)}"],
     "config.json: max_position_embeddings must be a positive integer, got 0"),
    ("field-gptj-dropout", lambda t, r: ["train", f"model.hf_checkpoint={_hf_other(t, **GPTJ, resid_pdrop=2)}"],
     "config.json: resid_pdrop must be a number in [0, 1], got 2"),
    ("field-llama-init-range", lambda t, r: ["train", f"model.hf_checkpoint={_hf_other(t, **LLAMA, initializer_range=-1)}"],
     "config.json: initializer_range must be a number in (0, inf), got -1"),
    ("field-llama-use-cache", lambda t, r: ["train", f"model.hf_checkpoint={_hf_other(t, **LLAMA, use_cache='yes')}"],
     "config.json: use_cache must be true or false, got the string 'yes'"),
    ("field-llama-act-type", lambda t, r: ["train", f"model.hf_checkpoint={_hf_other(t, **LLAMA, hidden_act=1)}"],
     "config.json: hidden_act must be text, got 1"),
    ("field-architectures", lambda t, r: ["train", f"model.hf_checkpoint={_hf_other(t, **LLAMA, architectures='Llama')}"],
     "config.json: architectures must be a list of class names, got the string 'Llama'"),
    ("field-unknown-nan", lambda t, r: ["train", f"model.hf_checkpoint={_hf_other(t, **LLAMA, quant={'scales': [1.0, float('nan')]})}"],
     "config.json: quant.scales[1] must be a finite number, got NaN or an infinity"),
    ("field-export-pass-through", lambda t, r: ["export", "--checkpoint", str(_with_source(t, r, max_position_embeddings="lots")),
                                                "--hf", str(t / "out")],
     "model.family=gptj: the source's config.json (hf_config.json) does not describe the model: "
     "max_position_embeddings must be a positive integer, got the string 'lots'"),
    ("window-zero", lambda t, r: [*PLAN_LLAMA, "plugins.llama.sliding_window=0"],
     "plugins.llama.sliding_window: must be a positive number of positions of at most 16777216 (null: no window), "
     "got 0"),
]


@pytest.mark.parametrize(("args", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_value_is_one_line_exit_2_and_changes_nothing(tmp_path, trained, capsys, monkeypatch, args, fragment):
    assert assert_one_clear_line(tmp_path, trained, capsys, monkeypatch, args, fragment) == 2


def test_an_out_of_vocabulary_end_of_text_is_no_stop_and_never_exported(tmp_path):
    """The tokenizer's <|endoftext|> guessed as the end of a document when it is no token of the model: none."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from ipuft.data.tokenizer import load_tokenizer, specials

    directory = tmp_path / "tok"
    directory.mkdir()
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 90)}, "<|endoftext|>": 90}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<unk>", "<|endoftext|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    loaded = load_tokenizer(str(directory))
    small = load_config("tiny", [f"data.tokenizer={directory}", "model.embedding.vocab_size=64"])
    large = load_config("tiny", [f"data.tokenizer={directory}"])
    assert specials(loaded, small).eos is None
    assert specials(loaded, large).eos == 90


# ---- what transformers computes, number for number ----

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_hf(tmp_path_factory.mktemp("rope") / "llama", "llama", seed=3)[1]


ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# (config.json's rope keys, the rotary base and plugins.llama.rope_scaling transformers 5 reads from them)
ROPE_COMBINATIONS = {
    "parameters-only": ({"rope_parameters": {**LLAMA3, "original_max_position_embeddings": 16, "rope_theta": 5000.0}},
                        5000.0, {**LLAMA3, "original_max_position_embeddings": 16}),
    "theta-only": ({"rope_theta": 20000.0}, 20000.0, None),
    "both-thetas-differ": ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rope_theta": 10.0},
                           500000.0, None),
    "scaling-replaces-parameters": ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                                     "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 30000.0},
                                    30000.0, {"rope_type": "linear", "factor": 4.0}),
    "parameters-without-theta": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 30000.0},
                                 30000.0, {"rope_type": "linear", "factor": 2.0}),
    "no-theta-anywhere": ({"rope_parameters": {"type": "linear", "factor": 2.0}}, 10000.0,
                          {"rope_type": "linear", "factor": 2.0}),
    "llama3-without-original-positions": ({"rope_parameters": {**LLAMA3, "rope_theta": 5000.0}}, 5000.0,
                                          {**LLAMA3, "original_max_position_embeddings": SHAPE["max_position_embeddings"]}),
}


@pytest.mark.parametrize("name", ROPE_COMBINATIONS)
def test_rope_keys_are_read_with_transformers_precedence(hooks, llama_dir, tmp_path, name):
    """Each combination of rope_parameters, rope_theta and rope_scaling: the rotary ipuft reads is the one
    transformers loads from the same directory, and the logits are equal."""
    from transformers import AutoModelForCausalLM

    keys, theta, scaling = ROPE_COMBINATIONS[name]
    src = tmp_path / name
    shutil.copytree(llama_dir, src)
    config = {k: v for k, v in json.loads((src / "config.json").read_text()).items() if k not in ROPE_KEYS}
    (src / "config.json").write_text(json.dumps({**config, **keys}))
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_theta"] == theta
    cfg = match_transformers(hooks, hf, src)
    read = cfg.plugins.llama.rope_scaling
    assert cfg.model.attention.rotary_positional_embeddings_base == theta
    assert (None if read is None else {k: read[k] for k in scaling}) == scaling  # linear's other fields unused


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_head_dim_other_than_hidden_over_heads_matches_transformers(hooks, tmp_path, kind):
    """Mistral NeMo's shape: 6 heads of 16 over a hidden size of 48 (q is 96 wide): logits, loss, every
    gradient, as transformers computes them."""
    hf, src = save_hf(tmp_path / kind, kind, seed=4, head_dim=16)
    assert hf.model.layers[0].self_attn.q_proj.weight.shape == (96, 48)
    cfg = match_transformers(hooks, hf, src)
    assert (cfg.plugins.llama.head_dim, cfg.model.attention.rotary_dim, cfg.model.hidden_size) == (16, 16, 48)


WINDOWS = {"absent": {}, "null": {"sliding_window": None}, "set": {"sliding_window": 64}}


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
@pytest.mark.parametrize("window", WINDOWS)
def test_window_and_key_value_heads_default_as_in_transformers(kind, window):
    """config.json without sliding_window or num_key_value_heads: ipuft reads what transformers' config class
    does (MistralConfig windows at 4096 and has 8 key/value heads; Qwen2Config 32 and a window only with
    use_sliding_window)."""
    import transformers

    shape = {k: v for k, v in SHAPE.items() if k != "num_key_value_heads"}
    config_class = getattr(transformers, {"mistral": "MistralConfig", "qwen2": "Qwen2Config"}[kind])
    config = {**shape, "num_attention_heads": 32, "hidden_size": 256, **WINDOWS[window]}
    for use in ([False, True] if kind == "qwen2" else [None]):
        given = config if use is None else {**config, "use_sliding_window": use}
        theirs, ours = config_class(**given), read_config(given, kind)
        assert ours["plugins.llama.sliding_window"] == theirs.sliding_window, (kind, window, use)
        assert ours["plugins.llama.kv_heads"] == theirs.num_key_value_heads, (kind, window, use)
    if kind == "qwen2":  # named explicitly, null key/value heads are all of them (MistralConfig refuses a null)
        explicit = {**config, "num_key_value_heads": None}
        assert read_config(explicit, kind)["plugins.llama.kv_heads"] == config_class(**explicit).num_key_value_heads == 32


def test_a_mistral_config_without_a_window_exports_its_window(hooks, tmp_path):
    """The window read from transformers' default is the one an export writes back."""
    from ipuft_llama.family import write_config

    src = _write(tmp_path / "m" / "config.json", json.dumps({**LLAMA, "model_type": "mistral"})).parent
    cfg = load_config(None, [f"model.hf_checkpoint={src}", "model.sequence_length=64"],
                      hooks.registrations.config_sections)
    assert cfg.plugins.llama.sliding_window == 4096
    assert write_config(cfg, "mistral")["sliding_window"] == 4096
