"""``ipuft export --gguf``: a tiny Llama, Qwen2 (tied embeddings), Qwen3, Mistral and Gemma 3, imported and trained at
learning rate 0 (so their checkpoints are the source's weights, bit for bit: test_llama, test_families), exported
as GGUF in each type and reloaded by transformers' GGUF reader (``from_pretrained(..., gguf_file=...)``): logits,
the tokenizer read back, the metadata llama.cpp reads, a LoRA run exported merged, and one line for what GGUF
cannot carry or a missing ``gguf`` package.

The models are 64 wide so that q8_0's 32-long blocks fit their rows; their MLP is 80 wide, so ``ffn_down``'s
rows are not, and fall back to f16 in q8_0 as llama.cpp's converter does. What transformers' reader does not read
shapes them too: Qwen3's head_dim is its default 128 (the reader drops ``key_length``), Gemma 3 has the default
layer pattern (five sliding layers, then a global one), local base and query_pre_attn_scalar = head_dim = 256.
"""

import contextlib
import copy
import hashlib
import io
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from cli_helpers import run_cli
from llama_reference import LLAMA3_SCALING, hf_model, tokenizer_json

from ipuft.cli.main import main
from ipuft.config import load_config
from ipuft.io.gguf_export import write_gguf
from ipuft.io.gguf_tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT
from ipuft.plugins import create_plugin_manager
from ipuft.run.train import train

TYPES = ["f32", "f16", "bf16", "q8_0"]
VOCAB = 384  # embedding rows; the tokenizers have 360 and 373 tokens: the GGUF vocabulary is padded with [PADn]
WIDE = {"hidden_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 64, "rope_scaling": None}
# kind: (its config, its tokenizer's style)
MODELS = {
    "llama": ({**WIDE, "num_attention_heads": 4, "num_key_value_heads": 2}, "llama-bpe"),
    "qwen2": ({**WIDE, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}, "qwen2"),
    "qwen3": ({**WIDE, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}, "gpt-2"),
    "mistral": ({**WIDE, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": None}, "llama"),
    "gemma3_text": ({**WIDE, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 256,
                     "query_pre_attn_scalar": 256, "num_hidden_layers": 6, "sliding_window_pattern": 6,
                     "rope_local_base_freq": 10000.0, "sliding_window": 5, "initializer_range": 0.02}, "gemma"),
}
CORPUS = ["the cat sat on the mat", "a quick brown fox jumps over the lazy dog", "Hello, world! 123 4567 89",
          "naïve café — déjà vu", "tabs\tand\nnewlines  and   spaces", "don't we'll they're I'm"] * 10
TEXTS = ["the cat sat on the mat", "Hello, world! 1234567 zebra ünïcode ✓", "  two  spaces\nand a line",
         "they'll don't", "<|im_end|> <end_of_turn> text"]
CHAT = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def byte_level_tokenizer(directory: Path, style: str) -> None:
    """A byte-level BPE trained on :data:`CORPUS` (360 tokens) with the split of ``style`` (``gpt-2``: ByteLevel's
    own regex, ``llama-bpe``: Llama 3's, which also puts its bos first, ``qwen2``: Qwen2's), saved with its
    tokenizer_config.json and chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    if style == "gpt-2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        split = {"llama-bpe": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}[style]
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"),
                                                           pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                    use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=360, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if style == "llama-bpe":
        tokenizer.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                                 special_tokens=[("<|im_start|>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                         unk_token="<|endoftext|>", chat_template=CHAT).save_pretrained(directory)


def sentencepiece_tokenizer(directory: Path, style: str) -> None:
    """Gemma's tokenizer (``gemma``) or Llama 2's and Mistral's (``llama``) as transformers builds them
    (``GemmaTokenizer``: BPE with byte fallback, ``▁`` for a space, no prefix, a bos before each text;
    ``LlamaTokenizer``: the same with a prefix space) over pieces trained on :data:`CORPUS`: specials, the 256
    byte tokens, then the pieces."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE(byte_fallback=True))
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=110, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    specials = {"gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"],
                "llama": ["<unk>", "<s>", "</s>"]}[style]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for piece in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) for m in model["merges"]]
    if style == "gemma":
        tokenizer = transformers.GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True,
                                                additional_special_tokens=specials[5:], chat_template=CHAT)
    else:
        tokenizer = transformers.LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, chat_template=CHAT)
    tokenizer.save_pretrained(directory)


def trained_run(root: Path, kind: str, config: dict, style: str | None, *extra: str, lr: float = 0.0, seed: int = 0):
    """transformers' model of ``kind`` with ``config`` and a tokenizer of ``style`` (None: the suite's
    word-level one), saved as a Hugging Face directory, imported and trained a step at learning rate ``lr``:
    ``(model, directory, run)``."""
    hooks = create_plugin_manager()
    model = hf_model(kind, seed, **config)
    if kind == "gemma3_text":  # Gemma's gains are 1 + w: w near 0, as real checkpoints have them
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.1)
    model.save_pretrained(root / "src")
    if style in ("gemma", "llama"):
        sentencepiece_tokenizer(root / "src", style)
    elif style is None:
        tokenizer_json(root / "src" / "tokenizer.json", config.get("vocab_size", 101))
    else:
        byte_level_tokenizer(root / "src", style)
    cfg = load_config(None, [f"model.hf_checkpoint={root / 'src'}", "model.sequence_length=16",
                             "training.global_batch_size=2", "training.steps=1",
                             f"training.optimizer.learning_rate.maximum={lr}", f"output_dir={root / 'run'}", *extra],
                      hooks.registrations.config_sections)
    train(cfg, hooks, progress=False)
    return model, root / "src", root / "run"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Each kind's run, exported through the command line in each type: ``{kind: (model, source, run, out)}``,
    ``out`` holding ``<type>.gguf``."""
    made = {}
    for seed, (kind, (config, style)) in enumerate(MODELS.items()):
        root = tmp_path_factory.mktemp(f"gguf-{kind}")
        model, src, run = trained_run(root, kind, config, style, seed=seed)
        for gguf_type in TYPES:
            out = root / "out" / f"{gguf_type}.gguf"
            code, stdout, err = _export(run, out, gguf_type)
            assert (code, stdout) == (0, f"wrote {out}\n"), err
        made[kind] = (model, src, run, root / "out")
    return made


def _export(run: Path, out: Path, gguf_type: str):
    """``ipuft export --checkpoint RUN --gguf OUT --gguf-type TYPE``: ``(code, stdout, stderr)``."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as info:
        main(["export", "--checkpoint", str(run), "--gguf", str(out), "--gguf-type", gguf_type])
        raise SystemExit(0)
    return info.value.code or 0, stdout.getvalue(), stderr.getvalue()


def rounded(model, gguf_type: str):
    """``model`` with every matrix as a GGUF file of ``gguf_type`` holds it (gguf's own quantize, then
    dequantize; f16 where q8_0's blocks do not fit a row), its vectors as they are."""
    types = gguf.GGMLQuantizationType
    qtype = {"f32": types.F32, "f16": types.F16, "bf16": types.BF16, "q8_0": types.Q8_0}[gguf_type]
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            if p.dim() > 1:
                kind = types.F16 if qtype == types.Q8_0 and p.shape[-1] % 32 else qtype
                values = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), kind), kind)
                p.copy_(torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(p.shape)))
    return out


def reloaded(out: Path, gguf_type: str):
    return transformers.AutoModelForCausalLM.from_pretrained(out, gguf_file=f"{gguf_type}.gguf",
                                                             dtype=torch.float32).eval()


IDS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))


# The farthest the logits may drift from the model's own, as a fraction of the largest logit: four times the
# type's unit roundoff (2^-11, 2^-8), an element's relative rounding error, which the logits carry through the
# layers; q8_0 rounds each element to a 127th of its block's largest, which relative to a Gaussian element is
# about 1e-2, and the bound is five times that.
DRIFT = {"f32": 1e-6, "f16": 4 * 2**-11, "bf16": 4 * 2**-8, "q8_0": 5e-2}


@pytest.mark.parametrize("gguf_type", TYPES)
@pytest.mark.parametrize("kind", list(MODELS))
def test_the_gguf_reloads_in_transformers_with_the_models_logits(exports, kind, gguf_type):
    """f32 is the model itself: its logits within 1e-5 (measured 0). f16, bf16 and q8_0 change the matrices
    alone, each element rounded to the type (q8_0: to one of 255 steps of its 32-long block's largest value, f16
    where a row is not 32-long blocks): the reload's logits are within 1e-5 of the same model with its matrices
    rounded so (measured 0: every tensor is where it belongs and holds exactly its value in the type), and their distance
    from the model's own is what that rounding does (:data:`DRIFT`; measured, of the largest logit: f16 2.9e-4 to
    1.1e-3, bf16 2.1e-3 to 7.1e-3, q8_0 6.7e-3 to 2.7e-2, Gemma 3's six layers the most)."""
    model, _, _, out = exports[kind]
    gguf_model = reloaded(out, gguf_type)
    # llama.cpp runs Mistral as a Llama: the same computation without a sliding window
    assert type(gguf_model) is (transformers.LlamaForCausalLM if kind == "mistral" else type(model))
    with torch.no_grad():
        ours, original, expected = gguf_model(IDS).logits, model(IDS).logits, rounded(model, gguf_type)(IDS).logits
    assert (ours - expected).abs().max() <= 1e-5
    drift = ((ours - original).abs().max() / original.abs().max()).item()
    print(f"{kind} {gguf_type}: max |logit - rounded| {(ours - expected).abs().max():.1e}, |logit - original| "
          f"{(ours - original).abs().max():.2e}, {drift:.1e} of the largest")
    assert drift <= DRIFT[gguf_type]


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_tokenizer_read_back_encodes_as_the_source(exports, kind):
    """transformers' tokenizer of the GGUF file encodes each text as the source's tokenizer does, and as ipuft's
    data does (the tokenizer.json, with its special tokens: Llama 3's style and Gemma's put a bos first), with
    the same special tokens and chat template."""
    from tokenizers import Tokenizer

    _, src, _, out = exports[kind]
    theirs = transformers.AutoTokenizer.from_pretrained(out, gguf_file="q8_0.gguf")
    source = transformers.AutoTokenizer.from_pretrained(src)
    ipuft = Tokenizer.from_file(str(src / "tokenizer.json"))
    for text in TEXTS:
        assert theirs(text).input_ids == source(text).input_ids == ipuft.encode(text).ids, text
    assert (theirs.bos_token, theirs.eos_token, theirs.chat_template) == (source.bos_token, source.eos_token, CHAT)
    assert theirs.decode(source("naïve café ✓").input_ids, skip_special_tokens=True) == "naïve café ✓"


def fields(path: Path) -> dict:
    """A GGUF file's metadata, each value as Python has it, and its tensors' types (``tensors``)."""
    reader = gguf.GGUFReader(path)
    out = {key: field.contents() for key, field in reader.fields.items()}
    out["tensors"] = {t.name: t.tensor_type.name for t in reader.tensors}
    return out


def test_the_metadata_is_what_llama_cpp_reads(exports):
    """The keys llama.cpp's loader reads for each architecture, the vocabulary padded to the embeddings' rows,
    the tokens' types, and the tensors' types (vectors f32, q8_0 matrices f16 where their rows are 80 long)."""
    _, _, _, out = exports["llama"]
    got = fields(out / "q8_0.gguf")
    assert {k: v for k, v in got.items() if k.startswith("llama.")} == pytest.approx({
        "llama.context_length": 64, "llama.embedding_length": 64, "llama.block_count": 2,
        "llama.feed_forward_length": 80, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
        "llama.attention.key_length": 16, "llama.attention.value_length": 16, "llama.rope.dimension_count": 16,
        "llama.rope.freq_base": 5000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": VOCAB})
    assert (got["general.architecture"], got["general.name"], got["general.file_type"]) == ("llama", "q8_0", 7)
    assert (got["tokenizer.ggml.model"], got["tokenizer.ggml.pre"]) == ("gpt2", "llama-bpe")
    tokens, types = got["tokenizer.ggml.tokens"], got["tokenizer.ggml.token_type"]
    assert len(tokens) == VOCAB and tokens[360:] == [f"[PAD{i}]" for i in range(360, VOCAB)]
    assert types[:4] == [3, 3, 3, 1] and set(types[360:]) == {5}  # control, then normal; padding unused
    assert (got["tokenizer.ggml.bos_token_id"], got["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert (got["tokenizer.ggml.add_bos_token"], got["tokenizer.ggml.add_eos_token"]) == (True, False)
    assert got["tokenizer.chat_template"] == CHAT
    assert got["tensors"]["blk.0.ffn_down.weight"] == "F16" and got["tensors"]["blk.0.attn_norm.weight"] == "F32"
    assert {got["tensors"][n] for n in ("token_embd.weight", "output.weight", "blk.1.attn_q.weight")} == {"Q8_0"}

    _, _, _, out = exports["gemma3_text"]
    got = fields(out / "bf16.gguf")
    assert (got["general.architecture"], got["general.file_type"], got["gemma3.block_count"]) == ("gemma3", 32, 6)
    assert (got["gemma3.attention.key_length"], got["gemma3.attention.sliding_window"]) == (256, 5)
    assert (got["gemma3.rope.freq_base"], "output.weight" in got["tensors"]) == (20000.0, False)  # tied
    assert (got["tokenizer.ggml.model"], got["tokenizer.ggml.add_space_prefix"]) == ("llama", False)
    assert (got["tokenizer.ggml.add_bos_token"], got["tokenizer.ggml.bos_token_id"]) == (True, 2)
    tokens, types, scores = got["tokenizer.ggml.tokens"], got["tokenizer.ggml.token_type"], got["tokenizer.ggml.scores"]
    assert [types[tokens.index(t)] for t in ("<bos>", "<unk>", "<0x41>", "<end_of_turn>")] == [3, 2, 6, 3]
    assert scores[7 + 256] == 0.0 and min(scores) < -50  # a character first, then the merges' pieces, earliest highest
    assert got["tensors"]["blk.5.attn_q_norm.weight"] == "F32" and got["tensors"]["blk.5.attn_q.weight"] == "BF16"

    _, _, _, out = exports["mistral"]
    assert fields(out / "f32.gguf")["tokenizer.ggml.add_space_prefix"] is True  # Llama 2's ▁ before a text


@pytest.mark.parametrize("scaling", ["llama3", "linear"])
def test_rope_scaling_is_written_as_llama_cpp_reads_it(tmp_path, scaling):
    """Llama 3.1's scaling as llama.cpp's rope_freqs tensor (each frequency's divisor: the base's frequencies over
    it are transformers' scaled ones), linear scaling as its two keys. transformers' GGUF reader reads neither, so
    the file is read here."""
    config = {**WIDE, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rope_scaling": LLAMA3_SCALING if scaling == "llama3" else {"rope_type": "linear", "factor": 4.0}}
    model = hf_model("llama", **config)
    model.save_pretrained(tmp_path / "src")
    byte_level_tokenizer(tmp_path / "src", "gpt-2")
    family = create_plugin_manager().registrations.families.get("llama")
    write_gguf(tmp_path / "src", tmp_path / "m.gguf", "f16", family, "m")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    if scaling == "linear":
        assert reader.fields["llama.rope.scaling.type"].contents() == "linear"
        assert reader.fields["llama.rope.scaling.factor"].contents() == 4.0
        assert "rope_freqs.weight" not in {t.name for t in reader.tensors}
        return
    factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    assert factors.tensor_type.name == "F32"
    base = 5000.0 ** -(torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    scaled = model.model.rotary_emb.inv_freq
    assert torch.allclose(base / torch.from_numpy(np.array(factors.data)), scaled, rtol=1e-6)
    assert not torch.allclose(base, scaled)  # the scaling changes some frequencies here


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def refused(capsys, root: Path, *args: str) -> str:
    """``ipuft ARGS`` exits 2 with one ``ipuft: error:`` line and no traceback, nothing under ``root`` changed;
    the line without its prefix."""
    capsys.readouterr()
    before = snapshot(root)
    code, _, err = run_cli(capsys, *args)
    lines = [line for line in err.splitlines() if not line.startswith("ipuft: recipe ") and "(auto: " not in line
             and "ipuft: warning: model.precision" not in line]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("ipuft: error: "), err
    assert snapshot(root) == before
    return lines[0][len("ipuft: error: "):]


WRITES = "it writes llama, mistral, qwen2, qwen3, gemma3_text"
BYTE_LEVEL = ("a GGUF export writes byte-level BPE (GPT-2, Llama 3, Qwen) and byte-fallback BPE (Llama 2, Mistral, "
              "Gemma) tokenizers only")
# A run the command line refuses to export as GGUF: (kind, config, tokenizer, the line).
CLI_REFUSED = {
    "mistral-window": ("mistral", {**WIDE, "num_attention_heads": 4, "num_key_value_heads": 2}, "gpt-2",
                       "--gguf: mistral with sliding_window=32 has no GGUF form llama.cpp runs; llama.cpp's llama "
                       "attends over the whole context: export mistral with sliding_window null"),
    "word-level": ("llama", {**WIDE, "num_attention_heads": 4, "num_key_value_heads": 2}, None,
                   f"--gguf: the tokenizer is WordLevel (tokenizer.json's model.type); {BYTE_LEVEL}"),
    "gemma3-pattern": ("gemma3_text", {**WIDE, "num_attention_heads": 2, "num_key_value_heads": 1}, "gemma",
                       "--gguf: gemma3_text with another layer pattern has no GGUF form llama.cpp runs; llama.cpp "
                       "runs Gemma 3's sliding window on five layers of six, every sixth global"),
}


@pytest.mark.parametrize("case", list(CLI_REFUSED))
def test_what_gguf_cannot_carry_is_one_line_before_anything_is_written(capsys, tmp_path, case):
    kind, config, style, line = CLI_REFUSED[case]
    _, _, run = trained_run(tmp_path, kind, config, style)
    out = tmp_path / "out" / "m.gguf"
    assert refused(capsys, tmp_path, "export", "--checkpoint", str(run), "--gguf", str(out)) == line


def test_a_family_without_a_gguf_form_is_one_line(capsys, tmp_path, trained):
    assert refused(capsys, tmp_path, "export", "--checkpoint", str(trained / "run"), "--gguf",
                   str(tmp_path / "m.gguf")) == f"--gguf: model.family=gptj has no GGUF export here; {WRITES}"


def _settings(kind: str, **config) -> dict:
    import transformers as t
    from llama_reference import CLASSES, KINDS, SHAPE

    family = create_plugin_manager().registrations.families.get(kind)
    return family.read_config(getattr(t, CLASSES[kind][0])(**{**SHAPE, **KINDS[kind], **config}).to_dict())


GEMMA3 = {"head_dim": 256, "query_pre_attn_scalar": 256, "num_hidden_layers": 6, "sliding_window_pattern": 6,
          "rope_local_base_freq": 10000.0, "rope_scaling": None}
# (kind, config.json's changes, the line): each refused by what the family reads from config.json.
CONFIG_REFUSED = {
    "olmo2": ("olmo2", {}, f"--gguf: model.family=olmo2 has no GGUF export here; {WRITES}"),
    "gemma2": ("gemma2", {}, f"--gguf: model.family=gemma2 has no GGUF export here; {WRITES}"),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 8},
                     "--gguf: qwen2 with sliding_window=8 has no GGUF form llama.cpp runs; llama.cpp's qwen2 attends "
                     "over the whole context: export qwen2 with use_sliding_window false"),
    "qwen2-llama3": ("qwen2", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
                     "--gguf: qwen2 with llama3 rope scaling has no GGUF form llama.cpp runs; llama3 scaling is "
                     "Llama's"),
    "llama-bias": ("llama", {"attention_bias": True},
                   "--gguf: llama with attention_bias or mlp_bias is not exported to GGUF here (transformers' GGUF "
                   "reader would drop the biases, so nothing checks them); it writes Qwen2's q/k/v biases only"),
    "gemma3-local": ("gemma3_text", {**GEMMA3, "rope_local_base_freq": 100.0},
                     "--gguf: gemma3_text with rope_local_base_freq=100 has no GGUF form llama.cpp runs; llama.cpp's "
                     "is 10000"),
    "gemma3-scalar": ("gemma3_text", {**GEMMA3, "query_pre_attn_scalar": 12},
                      "--gguf: gemma3_text with query_pre_attn_scalar=12.0 has no GGUF form llama.cpp runs; llama.cpp "
                      "scales by 256 ** -0.5 at 6 layers"),
    "gemma3-window": ("gemma3_text", {**GEMMA3, "sliding_window": None},
                      "--gguf: gemma3_text with another layer pattern has no GGUF form llama.cpp runs; llama.cpp runs "
                      "Gemma 3's sliding window on five layers of six, every sixth global"),
}


@pytest.mark.parametrize("case", list(CONFIG_REFUSED))
def test_each_config_without_a_gguf_form_is_one_line(case):
    from ipuft.errors import CheckpointError
    from ipuft.io.gguf_export import check_model

    kind, config, line = CONFIG_REFUSED[case]
    with pytest.raises(CheckpointError) as info:
        check_model(kind, _settings(kind, **config))
    assert str(info.value) == line


def test_gemma3_and_qwen3_defaults_are_accepted():
    from ipuft.io.gguf_export import check_model

    assert check_model("gemma3_text", _settings("gemma3_text", **GEMMA3)) == "gemma3"
    assert check_model("qwen3", _settings("qwen3")) == "qwen3"


def test_targets_a_failure_and_an_earlier_export(capsys, tmp_path, exports, monkeypatch):
    """An earlier GGUF file is replaced whole; another file, or a directory, is one line; a failure half way
    (a full disk) leaves the earlier file as it was and nothing beside it."""
    _, _, run, out = exports["llama"]
    target = tmp_path / "f32.gguf"  # general.name: f32, as in the first export
    target.write_bytes((out / "q8_0.gguf").read_bytes())
    code, stdout, err = run_cli(capsys, "export", "--checkpoint", str(run), "--gguf", str(target), "--gguf-type", "f32")
    assert (code, stdout) == (0, f"wrote {target}\n"), err
    assert target.read_bytes() == (out / "f32.gguf").read_bytes()  # the same bytes as the first f32 export

    calls = []

    def full(array, kind, real=gguf.quants.quantize):
        calls.append(kind)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(array, kind)

    monkeypatch.setattr(gguf.quants, "quantize", full)
    assert refused(capsys, tmp_path, "export", "--checkpoint", str(run), "--gguf", str(target)) == \
        f"--gguf {target} cannot be written (No space left on device); nothing was left behind"
    monkeypatch.undo()
    (tmp_path / "other").write_text("not a GGUF file")
    assert refused(capsys, tmp_path, "export", "--checkpoint", str(run), "--gguf", str(tmp_path / "other")) == \
        f"--gguf {tmp_path / 'other'} exists and is not an earlier export of its kind; choose a new file"
    (tmp_path / "d").mkdir()
    assert refused(capsys, tmp_path, "export", "--checkpoint", str(run), "--gguf", str(tmp_path / "d")) == \
        f"--gguf {tmp_path / 'd'} is a directory; name the file to write"
    assert refused(capsys, tmp_path, "export", "--checkpoint", str(run), "--gguf", str(tmp_path / "h" / "m.gguf"),
                   "--hf", str(tmp_path / "h")) == \
        f"export: --hf {tmp_path / 'h'} and --gguf {tmp_path / 'h' / 'm.gguf'} overlap; give each its own file"
    assert refused(capsys, tmp_path, "export", "--checkpoint", str(run), "--gguf", str(target), "--dtype",
                   "float16") == "export: --dtype is the type of --hf and --adapter; --gguf takes --gguf-type"


def test_without_the_gguf_package_the_export_says_which_extra_to_install(capsys, tmp_path, exports, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # what an import finds when the package is not installed
    _, _, run, _ = exports["qwen2"]
    assert refused(capsys, tmp_path, "export", "--checkpoint", str(run), "--gguf", str(tmp_path / "m.gguf")) == \
        "--gguf: writing a GGUF file needs the gguf package (llama.cpp's writer); pip install 'ipuft[gguf]'"


def test_a_lora_run_exports_merged(capsys, tmp_path):
    """LoRA adapters trained two steps (so B is no longer 0) are in the GGUF file merged: its logits are the
    merged Hugging Face export's, written by the same command."""
    config, style = MODELS["llama"]
    _, _, run = trained_run(tmp_path, "llama", config, style, "model.adapter=lora", "plugins.lora.rank=2",
                            "plugins.lora.targets=[q,k,v,down]", "training.steps=2", lr=5e-2)
    code, _, err = run_cli(capsys, "export", "--checkpoint", str(run), "--hf", str(tmp_path / "hf"), "--gguf",
                           str(tmp_path / "m.gguf"), "--gguf-type", "f32")
    assert code == 0, err
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    source = hf_model("llama", 0, **config)
    with torch.no_grad():
        assert (theirs.eval()(IDS).logits - merged(IDS).logits).abs().max() <= 1e-5
        assert (merged(IDS).logits - source(IDS).logits).abs().max() > 1e-3  # the adapters changed the model
