"""The real-data pipeline: readers, formats, packing and masking, sampling, DP split, errors, the sample."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from omegaconf import OmegaConf

from ipuft.components import IGNORE_INDEX
from ipuft.config import load_config
from ipuft.data.files import read_rows, resolve_data_path
from ipuft.data.synthetic import SampleData
from ipuft.data.templates import TEMPLATES, Template, resolve_template
from ipuft.data.tokenizer import load_tokenizer
from ipuft.data.tokens import TokenDataset, data_source
from ipuft.errors import DataError

tokenizers = pytest.importorskip("tokenizers")

EOS = "<|endoftext|>"
ROWS = [{"premise": "a cat sat", "hypothesis": "a cat", "label": 0},
        {"premise": "the dog ran", "hypothesis": "no dog ran", "label": 2},
        {"premise": "it rained", "hypothesis": "it rained hard", "label": 1}]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A tiny byte-level BPE with EOS at id 0, trained here (no network)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = ["".join(TEMPLATES["mnli"].render(r, "x")) for r in ROWS] * 5
    tok.train_from_iterator(texts, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tok(tokenizer_file):
    return load_tokenizer(str(tokenizer_file))


def config(path, *overrides, seq=8, vocab=512):
    return load_config("tiny", [f"data.path={path}", f"model.sequence_length={seq}",
                                f"model.embedding.vocab_size={vocab}", *overrides])


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tokens_dataset(tmp_path, seqs, *overrides, seq=4, vocab=512):
    path = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": s} for s in seqs])
    return TokenDataset.from_config(config(path, "data.format=tokens", *overrides, seq=seq, vocab=vocab), None)


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


# -- Readers -------------------------------------------------------------------------------------------


def test_every_reader_yields_the_same_rows(tmp_path):
    rows = [{"premise": "a, \"quoted\" cat", "hypothesis": "b c", "label": "0"},
            {"premise": "x", "hypothesis": "y", "label": "2"}]
    write_jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "d.json").write_text(json.dumps(rows))
    for suffix, delimiter in ((".csv", ","), (".tsv", "\t")):
        with (tmp_path / f"d{suffix}").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter=delimiter)
            writer.writeheader()
            writer.writerows(rows)
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    expected = list(enumerate(rows, 1))
    for suffix in (".jsonl", ".json", ".csv", ".tsv", ".parquet"):
        assert list(read_rows(tmp_path / f"d{suffix}")) == expected, suffix

    (tmp_path / "d.txt").write_text("first line\n\nsecond line\r\n")
    assert list(read_rows(tmp_path / "d.txt")) == [(1, {"text": "first line"}), (3, {"text": "second line"})]


def test_unknown_suffix_lists_the_supported_ones(tmp_path):
    (tmp_path / "d.xml").write_text("<a/>")
    with pytest.raises(DataError, match=r"d\.xml: unsupported file type '\.xml'; supported: \.jsonl, \.json"):
        list(read_rows(tmp_path / "d.xml"))


# -- Templates -----------------------------------------------------------------------------------------


def test_mnli_template_maps_labels():
    mnli = resolve_template("mnli")
    row = {"premise": "It rained.", "hypothesis": "It was wet.", "label": 2}
    assert mnli.render(row, "f row 1") == ("mnli hypothesis: It was wet. premise: It rained. target:",
                                          f" contradiction{EOS}")
    assert mnli.render({**row, "label": "0"}, "f row 1")[1] == f" entailment{EOS}"
    assert mnli.render({**row, "label": "neutral"}, "f row 1")[1] == f" neutral{EOS}"


def test_literal_template_has_no_target():
    t = resolve_template("Q: {q} A: {a}")
    assert t == Template(prompt="Q: {q} A: {a}") and t.target is None
    assert t.render({"q": "1+1", "a": 2, "label": 5}, "f row 1") == ("Q: 1+1 A: 2", "")


def test_missing_template_field(tmp_path, tok):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS[:2] + [{"hypothesis": "h", "label": 1}])
    with pytest.raises(DataError) as err:
        TokenDataset.from_config(config(path, seq=64), tok)
    assert str(err.value) == (f"{path} row 3: template field 'premise' is missing; the row has: "
                              f"hypothesis, label")


# -- Formats, packing and masking ----------------------------------------------------------------------


def test_tokens_exact_shift_without_padding(tmp_path):
    ds = tokens_dataset(tmp_path, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], "data.packing=false",
                        "data.shuffle=false")
    b = ds.batch(0, 2, 1)
    assert b.input_ids.dtype == b.labels.dtype == torch.int64 and b.input_ids.shape == (2, 1, 4)
    assert b.input_ids.tolist() == [[[1, 2, 3, 4]], [[6, 7, 8, 9]]]
    assert b.labels.tolist() == [[[2, 3, 4, 5]], [[7, 8, 9, 10]]]


def test_packing_concatenates_and_chunks(tmp_path):
    """Token rows are the user's own ids: the 3 that fill no chunk make a last row, padded, the padding out of
    the loss (text's remainder is dropped, as the reference's group_texts drops it)."""
    ds = tokens_dataset(tmp_path, [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12], [13]], "data.shuffle=false")
    assert len(ds) == 3  # 13 tokens → two chunks of 5 and a padded row of 3
    b = ds.batch(0, 3, 3)
    assert b.input_ids.tolist() == [[[1, 2, 3, 4], [6, 7, 8, 9], [11, 12, 13, 0]]]
    assert b.labels.tolist() == [[[2, 3, 4, 5], [7, 8, 9, 10], [12, 13, IGNORE_INDEX, IGNORE_INDEX]]]


def test_token_rows_shorter_than_the_sequence_are_padded_and_masked(tmp_path, capsys):
    """A newcomer's token rows, each shorter than model.sequence_length: packed (the default) they fill a padded
    row whose padding is out of the loss; unpacked each row is padded alone; never "the dataset is empty"."""
    rows = [[5, 6, 7], [8, 9]]
    packed = tokens_dataset(tmp_path, rows, "data.shuffle=false", seq=8)
    assert len(packed) == 1
    b = packed.batch(0, 1, 1)
    assert b.input_ids.tolist() == [[[5, 6, 7, 8, 9, 0, 0, 0]]]
    assert b.labels.tolist() == [[[6, 7, 8, 9] + [IGNORE_INDEX] * 4]]
    unpacked = tokens_dataset(tmp_path, rows, "data.shuffle=false", "data.packing=false", seq=8)
    b = unpacked.batch(0, 2, 1)
    assert b.input_ids.tolist() == [[[5, 6, 7, 0, 0, 0, 0, 0]], [[8, 9, 0, 0, 0, 0, 0, 0]]]
    assert b.labels.tolist() == [[[6, 7] + [IGNORE_INDEX] * 6], [[9] + [IGNORE_INDEX] * 7]]
    assert capsys.readouterr().err == ""


def test_examples_left_out_are_counted_with_their_lengths_and_the_key(tmp_path, capsys):
    tokens_dataset(tmp_path, [[1] * 5, [1] * 7, [1] * 9, [4], [2, 3]], "data.packing=false", "data.truncation=drop",
                   seq=4)
    name = tmp_path / "ids.jsonl"
    assert capsys.readouterr().err == (
        f"ipuft: note: {name}: 2 of 5 examples (7 to 9 tokens) are longer than model.sequence_length + 1 = 5 tokens "
        f"and were left out (data.truncation=drop); data.truncation=truncate keeps their first tokens\n"
        f"ipuft: note: {name}: 1 of 5 examples have no token to learn (one token, or none in the loss) and were "
        f"left out; data.packing=true with data.whole_examples=false keeps their tokens as context\n")


def test_unpacked_pads_and_masks_padding_and_prompt(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0]])
    ds = TokenDataset.from_config(config(path, "data.packing=false", seq=40), tok)
    prompt, target = TEMPLATES["mnli"].render(ROWS[0], "")
    p, t = ids(tok, prompt), ids(tok, target)
    assert t[-1] == 0  # EOS is the single special token
    row = p + t
    n = len(row)
    b = ds.batch(0, 1, 1)
    assert b.input_ids[0, 0].tolist() == (row + [0] * (41 - n))[:40]
    expected = [IGNORE_INDEX] * (len(p) - 1) + t + [IGNORE_INDEX] * (41 - n)
    assert b.labels[0, 0].tolist() == expected


def test_unpacked_text_masks_only_padding(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a cat sat"}])
    ds = TokenDataset.from_config(config(path, "data.format=text", "data.packing=false", seq=12), tok)
    row = ids(tok, "a cat sat")
    assert EOS not in tok.decode(row) and 0 not in row  # no EOS added
    labels = ds.batch(0, 1, 1).labels[0, 0].tolist()
    assert labels == row[1:] + [IGNORE_INDEX] * (13 - len(row))


def test_template_packing_puts_every_token_in_the_loss(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    ds = TokenDataset.from_config(config(path, "data.shuffle=false", seq=7), tok)
    stream = [i for r in ROWS for i in ids(tok, "".join(TEMPLATES["mnli"].render(r, "")))]
    assert len(ds) == len(stream) // 8
    b = ds.batch(0, len(ds), 1)
    assert b.input_ids.flatten().tolist() == [x for k in range(len(ds)) for x in stream[8 * k:8 * k + 7]]
    assert (b.labels != IGNORE_INDEX).all()


@pytest.fixture(scope="module")
def styled(tmp_path_factory):
    """A Llama-3-style and a ChatML-style tokenizer directory (tokenizer.json, tokenizer_config.json, ...)."""
    from llama_reference import styled_tokenizer

    root = tmp_path_factory.mktemp("styled")
    return {style: styled_tokenizer(root / style, style) for style in ("llama3", "chatml")}


def documents(style):
    """Fifteen short documents; one in five already ends with the style's eos."""
    from llama_reference import STYLES

    return ["w5 w6 w7", "w8 w9", f"w10 w11 {STYLES[style]['eos']}", "w12", "w13 w14 w15 w16"] * 3


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_packed_text_holds_the_tokenizers_specials_and_eos_between_documents(tmp_path, styled, style):
    """Each document is encoded as transformers' tokenizer of the directory encodes it (Llama 3: bos first;
    ChatML: nothing added) and, packed, ends with its tokenizer_config.json's eos unless it already does;
    data.add_eos=false leaves the eos out, and an unpacked document has none added."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(styled[style])
    docs = documents(style)
    encoded = [reference(doc)["input_ids"] for doc in docs]
    assert all((e[0] == reference.bos_token_id) == (style == "llama3") for e in encoded)
    eos = reference.eos_token_id
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": doc} for doc in docs])
    common = [f"data.tokenizer={styled[style]}", "data.format=text", "data.shuffle=false", "data.cache=false"]
    for add_eos in (True, False):
        ds = TokenDataset.from_config(config(path, *common, f"data.add_eos={add_eos}", seq=7, vocab=101),
                                      load_tokenizer(str(styled[style])))
        stream = [i for e in encoded for i in (e + [eos] if add_eos and e[-1] != eos else e)]
        assert ds.tokens.tolist() == stream[:len(ds) * 8] and len(ds) == len(stream) // 8
        assert stream.count(eos) == (len(docs) if add_eos else len(docs) // 5)
    unpacked = TokenDataset.from_config(config(path, *common, "data.packing=false", seq=7, vocab=101),
                                        load_tokenizer(str(styled[style])))
    assert [unpacked.tokens[a:b].tolist() for a, b in zip(unpacked.offsets, unpacked.offsets[1:])] == \
        [e for e in encoded if len(e) >= 2]


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_a_template_example_is_wrapped_as_the_tokenizer_wraps_a_text(tmp_path, styled, style):
    """The prompt's loss mask moves with the tokenizer's bos: the target starts at the same token it would
    in the tokenizer's encoding of prompt + target."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(styled[style])
    rows = [{"q": "w5 w6", "a": "w7 w8"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    ds = TokenDataset.from_config(config(path, f"data.tokenizer={styled[style]}", "data.template={q} w3 {a}",
                                         "data.packing=false", "data.cache=false", seq=8, vocab=101),
                                  load_tokenizer(str(styled[style])))
    assert ds.tokens.tolist() == reference("w5 w6 w3 w7 w8")["input_ids"]
    # With packing and add_eos, the template's example ends with the eos too.
    packed = TokenDataset.from_config(config(path, f"data.tokenizer={styled[style]}", "data.template={q} w3 {a}",
                                             "data.shuffle=false", "data.cache=false", seq=len(ds.tokens), vocab=101),
                                      load_tokenizer(str(styled[style])))
    assert packed.tokens.tolist() == reference("w5 w6 w3 w7 w8")["input_ids"] + [reference.eos_token_id]


def test_packed_text_without_an_eos_token_is_one_line(tmp_path, styled):
    """A tokenizer that names no eos (no tokenizer_config.json, no model eos, no <|endoftext|>) cannot end packed
    documents: one line saying how to go on, unless data.add_eos=false."""
    lone = tmp_path / "lone.json"
    lone.write_bytes((styled["llama3"] / "tokenizer.json").read_bytes())
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": doc} for doc in documents("llama3")])
    common = [f"data.tokenizer={lone}", "data.format=text", "data.cache=false"]
    with pytest.raises(DataError, match=r"^data.add_eos: the tokenizer names no end-of-sequence token .*"
                                        r"set data.add_eos=false") as info:
        TokenDataset.from_config(config(path, *common, seq=7, vocab=101), load_tokenizer(str(lone)))
    assert "\n" not in str(info.value)
    ds = TokenDataset.from_config(config(path, *common, "data.add_eos=false", seq=7, vocab=101),
                                  load_tokenizer(str(lone)))
    assert 2 not in ds.tokens.tolist()[:3] and ds.tokens.tolist()[0] == 1


# -- Sampling ------------------------------------------------------------------------------------------


def test_dp_replicas_split_the_global_batch(tmp_path):
    ds = tokens_dataset(tmp_path, [[i] * 5 for i in range(1, 13)], "data.packing=false")
    whole = ds.batch(3, 8, 2)
    parts = [ds.batch(3, 8, 2, rank, 2) for rank in range(2)]
    assert whole.input_ids.shape == (4, 2, 4) and parts[0].input_ids.shape == (2, 2, 4)
    for r in range(2):
        assert torch.equal(parts[r].input_ids, whole.input_ids[r::2])
        assert torch.equal(parts[r].labels, whole.labels[r::2])


def test_epochs_and_deterministic_shuffling(tmp_path):
    seqs = [[i] * 5 for i in range(1, 11)]

    def first_tokens(*overrides, steps=4):
        ds = tokens_dataset(tmp_path, seqs, "data.packing=false", *overrides)
        return [ds.batch(s, 5, 1).input_ids[:, 0, 0].tolist() for s in range(steps)]

    in_order = first_tokens("data.shuffle=false")
    assert in_order == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]] * 2  # epoch 2 starts again in file order
    a, b = first_tokens("data.seed=3"), first_tokens("data.seed=3")
    assert a == b != first_tokens("data.seed=4")
    epoch0, epoch1 = a[0] + a[1], a[2] + a[3]
    assert sorted(epoch0) == sorted(epoch1) == list(range(1, 11)) and epoch0 != epoch1
    # A global batch that straddles two epochs takes the end of one and the start of the next.
    ds = tokens_dataset(tmp_path, seqs, "data.packing=false", "data.seed=3")
    assert ds.batch(1, 6, 1).input_ids[:, 0, 0].tolist() == (epoch0 + epoch1)[6:12]


def test_state_dict_restores_the_position(tmp_path):
    seqs = [[i] * 5 for i in range(1, 8)]
    ds = tokens_dataset(tmp_path, seqs, "data.packing=false", "data.seed=5")
    for step in range(3):
        ds.batch(step, 4, 2)
    state = ds.state_dict()
    assert state["samples_seen"] == 12 and state["seed"] == 5
    fresh = tokens_dataset(tmp_path, seqs, "data.packing=false", "data.seed=9")
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert torch.equal(fresh.batch(3, 4, 2).input_ids, ds.batch(3, 4, 2).input_ids)
    assert torch.equal(fresh.batch_at(state["samples_seen"], 4, 2).labels, ds.batch(3, 4, 2).labels)
    other = tokens_dataset(tmp_path, seqs[:3], "data.packing=false")
    with pytest.raises(DataError, match="7 rows; this one has 3"):
        other.load_state_dict(state)


def test_eval_batches_cover_every_row_in_order(tmp_path):
    ds = tokens_dataset(tmp_path, [[i] * 5 for i in range(1, 6)], "data.packing=false", "data.seed=1")
    batches = list(ds.eval_batches(2))
    assert [b.input_ids.shape for b in batches] == [(1, 2, 4), (1, 2, 4), (1, 1, 4)]
    assert torch.cat([b.input_ids[0, :, 0] for b in batches]).tolist() == [1, 2, 3, 4, 5]


# -- Errors --------------------------------------------------------------------------------------------


def test_missing_file():
    with pytest.raises(DataError, match=r"^data\.path: nowhere/train\.jsonl does not exist$"):
        resolve_data_path("nowhere/train.jsonl")


def test_missing_tokenizer(tmp_path):
    with pytest.raises(DataError, match=r"^data\.tokenizer: no tokenizer\.json at .*tokenizer\.json; give a"):
        load_tokenizer(str(tmp_path))


def test_empty_dataset(tmp_path, tok):
    path = write_jsonl(tmp_path / "short.jsonl", [{"text": "a cat sat"}, {"text": "a cat"}])
    with pytest.raises(DataError) as err:  # a newcomer's text rows, shorter than the sequence: what would fit
        TokenDataset.from_config(config(path, "data.format=text", "data.add_eos=false", seq=64), tok)
    total = len(ids(tok, "a cat sat")) + len(ids(tok, "a cat"))
    assert str(err.value) == (f"{path}: the dataset is empty: its 2 examples hold {len(ids(tok, 'a cat'))} to "
                              f"{len(ids(tok, 'a cat sat'))} tokens ({total} in all), too few to fill one chunk of "
                              f"model.sequence_length + 1 = 65 tokens (data.packing=true concatenates and cuts "
                              f"them); set model.sequence_length to at most {total - 1}, or data.packing=false to "
                              f"pad each example (its padding out of the loss)")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: the dataset is empty \(no row holds a token\)$"):
        TokenDataset.from_config(config(tmp_path / "empty.jsonl", "data.format=tokens"), None)
    with pytest.raises(DataError) as err:  # every row too long, and dropped
        tokens_dataset(tmp_path, [[1] * 9, [1] * 12], "data.packing=false", "data.truncation=drop", seq=4)
    assert str(err.value) == (f"{tmp_path / 'ids.jsonl'}: the dataset is empty: its 2 examples hold 9 to 12 tokens "
                              f"(21 in all), and every one was left out (see the notes above: 2 longer than "
                              f"model.sequence_length + 1 = 5, 0 with no token to learn)")


def test_row_longer_than_the_sequence(tmp_path):
    with pytest.raises(DataError) as err:
        tokens_dataset(tmp_path, [[1] * 5, [1] * 6], "data.packing=false", seq=4)
    assert str(err.value) == (f"{tmp_path / 'ids.jsonl'} row 2: 6 tokens, longer than model.sequence_length "
                              f"+ 1 = 5; shorten it or set data.packing=true")


def test_bad_json_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"input_ids": [1, 2]}\n{"input_ids": [1,\n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 2: not valid JSON") as err:
        TokenDataset.from_config(config(tmp_path / "bad.jsonl", "data.format=tokens"), None)
    assert "\n" not in str(err.value)


def test_token_id_outside_the_vocabulary(tmp_path):
    with pytest.raises(DataError, match=r"ids\.jsonl row 2: token id 200 is outside the model's vocabulary "
                                        r"\(model\.embedding\.vocab_size = 128\)"):
        tokens_dataset(tmp_path, [[1, 2, 3], [4, 200]], vocab=128)


def test_template_needs_a_tokenizer(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError, match=r"^data\.tokenizer: format 'template' needs a tokenizer; set "
                                        r"data\.tokenizer=DIR or model\.hf_checkpoint=DIR$"):
        data_source(config(path))


# -- Sources and the shipped sample --------------------------------------------------------------------


def test_data_source_without_a_path_is_the_synthetic_sample():
    source = data_source(load_config("tiny", []))
    assert isinstance(source, SampleData)


def test_data_source_finds_the_tokenizer(tmp_path, tokenizer_file):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS * 4)
    by_dir = data_source(config(path, f"data.tokenizer={tokenizer_file.parent}", seq=16))
    # Set model.hf_checkpoint after validation, which would read the directory's config.json.
    cfg = OmegaConf.to_container(config(path, seq=16))
    cfg["model"]["hf_checkpoint"] = str(tokenizer_file.parent)
    by_checkpoint = data_source(OmegaConf.create(cfg))
    assert isinstance(by_dir, TokenDataset) and len(by_dir) == len(by_checkpoint) > 0
    assert torch.equal(by_dir.batch(0, 4, 2).input_ids, by_checkpoint.batch(0, 4, 2).input_ids)


def test_packaged_sample_loads_with_the_packaged_tokenizer():
    tok = load_tokenizer("sample")
    assert tok.get_vocab_size() == 512 and tok.token_to_id(EOS) == 0
    assert tok.encode(f"target: entailment{EOS}", add_special_tokens=False).ids[-1] == 0
    rows = list(read_rows(resolve_data_path("mnli-sample")))
    assert len(rows) >= 250
    text = " ".join("".join(TEMPLATES["mnli"].render(r, f"row {n}")) for n, r in rows)
    for name in TEMPLATES["mnli"].labels.values():
        assert f"target: {name}{EOS}" in text
    cfg = load_config("tiny", ["data.path=mnli-sample", "data.tokenizer=sample", "data.packing=false",
                               "model.sequence_length=80", "model.embedding.vocab_size=512"])
    ds = data_source(cfg)
    assert len(ds) == len(rows)
    b = ds.batch(0, 16, 1)
    assert b.input_ids.shape == (16, 1, 80) and int(b.input_ids.max()) < 512
    # Unpacked: only the target (label name and EOS) is in the loss.
    kept = b.labels[b.labels != IGNORE_INDEX]
    assert (kept == 0).sum() == 16


def test_tokenized_data_is_cached_and_a_second_run_reads_it_without_tokenizing(hooks, tmp_path, monkeypatch):
    import ipuft.data.tokens as datasets
    from ipuft.config import load_config

    monkeypatch.setenv("IPUFT_CACHE_DIR", str(tmp_path / "cache"))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"premise": f"cat {i} sleeps", "hypothesis": "a cat", "label": i % 3}) + "\n"
                            for i in range(40)))
    overrides = [f"data.path={rows}", "data.tokenizer=sample", "model.embedding.vocab_size=512",
                 "model.sequence_length=32"]
    sizes = {}
    for packing in ("true", "false"):
        cfg = load_config("tiny", [*overrides, f"data.packing={packing}"], hooks.registrations.config_sections)
        first = datasets.data_source(cfg)
        with monkeypatch.context() as m:
            m.setattr(datasets, "_encode", lambda *a: pytest.fail("tokenized again"))
            second = datasets.data_source(cfg)
        assert len(second) == len(first)
        sizes[packing] = len(first)
        assert all(torch.equal(first.row(i)[0], second.row(i)[0]) and torch.equal(first.row(i)[1], second.row(i)[1])
                   for i in range(len(first)))
    entries = sorted((tmp_path / "cache" / "tokens").iterdir())
    assert len(entries) == 2  # packed and unpacked are two entries
    # Another template, another file or another tokenizer is another entry; a damaged entry is rebuilt.
    cfg = load_config("tiny", [*overrides, "data.template={premise} => {hypothesis}"], hooks.registrations.config_sections)
    datasets.data_source(cfg)
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 3
    # What the encoding adds (the packed examples' eos) is in the key too.
    cfg = load_config("tiny", [*overrides, "data.add_eos=false"], hooks.registrations.config_sections)
    datasets.data_source(cfg)
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 4
    for entry in entries:
        (entry / "tokens.npy").write_bytes(b"garbage")
    encoded = []
    real_encode = datasets._encode
    monkeypatch.setattr(datasets, "_encode", lambda *a: encoded.append(1) or real_encode(*a))
    cfg = load_config("tiny", [*overrides, "data.packing=true"], hooks.registrations.config_sections)
    assert len(datasets.data_source(cfg)) == sizes["true"] and encoded  # rebuilt, not an error
    cfg = load_config("tiny", [*overrides, "data.cache=false"], hooks.registrations.config_sections)
    with monkeypatch.context() as m:
        m.setattr(datasets.TokenCache, "store", lambda *a: pytest.fail("cached though data.cache=false"))
        datasets.data_source(cfg)


def test_a_csv_with_a_byte_order_mark_reads_its_first_column(tmp_path):
    from ipuft.data.files import read_rows

    path = tmp_path / "rows.csv"
    path.write_bytes(b"\xef\xbb\xbfpremise,hypothesis,label\na cat,a pet,0\n")
    assert list(read_rows(path)) == [(1, {"premise": "a cat", "hypothesis": "a pet", "label": "0"})]
