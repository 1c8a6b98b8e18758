"""Instruction data (data.format=instruction): the response-only loss masks of Stanford Alpaca's template, with and
without an input, and of a literal template marked at its response, against masks written out by hand; packing
whole examples against the unpacked dataset; the new keys' bad values."""

from __future__ import annotations

import json
import re

import pytest
from cli_helpers import run_cli

from ipuft.components import IGNORE_INDEX
from ipuft.config import load_config
from ipuft.data.tokenizer import load_tokenizer
from ipuft.data.tokens import TokenDataset
from ipuft.errors import DataError

tokenizers = pytest.importorskip("tokenizers")

# Stanford Alpaca's prompts, written out here as its train.py has them.
WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
              "Write a response that appropriately completes the request.\n\n### Instruction:\n{i}\n\n### Input:\n"
              "{x}\n\n### Response:")
WITHOUT = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
           "request.\n\n### Instruction:\n{i}\n\n### Response:")
ROWS = [{"instruction": "add two and two", "input": "", "output": "four"},
        {"instruction": "translate", "input": "bonjour le monde", "output": "hello world"},
        {"instruction": "name a colour", "output": "red or blue"}]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A word-level tokenizer over every word here, </s> its eos (tokenizer_config.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for text in [WITH_INPUT, WITHOUT] + [v for r in ROWS for v in r.values()] for w in text.split()}
                   | {"Q:", "A:", "extra", "x"})
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    directory = tmp_path_factory.mktemp("instruction-tok")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return directory


def prepared(tmp_path, home, rows, *overrides, seq=64):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config("tiny", [f"data.path={path}", f"data.tokenizer={home}", "data.format=instruction",
                               "data.cache=false", "data.shuffle=false", f"model.sequence_length={seq}",
                               "model.embedding.vocab_size=128", *overrides])
    return TokenDataset.from_config(cfg, load_tokenizer(str(home)))


def by_hand(tok, prompt, response, eos=True):
    p = tok.encode(prompt, add_special_tokens=False).ids
    r = tok.encode(response, add_special_tokens=False).ids + ([tok.token_to_id("</s>")] if eos else [])
    return p + r, [0] * len(p) + [1] * len(r)


def examples(ds):
    return [(ds.tokens[a:b].tolist(), ds.mask[a:b].tolist()) for a, b in zip(ds.offsets, ds.offsets[1:])]


def test_alpaca_masks_the_prompt_with_and_without_input(tmp_path, home):
    """An empty or absent input takes the prompt without one; the response and its eos are the loss, nothing else."""
    tok = load_tokenizer(str(home))
    ds = prepared(tmp_path, home, ROWS, "data.packing=false")
    expected = [by_hand(tok, WITHOUT.format(i="add two and two"), "four"),
                by_hand(tok, WITH_INPUT.format(i="translate", x="bonjour le monde"), "hello world"),
                by_hand(tok, WITHOUT.format(i="name a colour"), "red or blue")]
    assert examples(ds) == expected
    ids, mask = expected[1]
    labels = ds.row(1)[1].tolist()
    assert labels == [i if m else IGNORE_INDEX for i, m in zip(ids[1:], mask[1:])] + [IGNORE_INDEX] * (65 - len(ids))
    assert sum(label != IGNORE_INDEX for label in labels) == 3  # "hello", "world", </s>


def test_a_literal_template_is_marked_at_its_response(tmp_path, home):
    """The target starts at the {<data.response_field>} placeholder, with renamed fields and without the eos."""
    tok = load_tokenizer(str(home))
    rows = [{"q": "translate", "a": "hello world"}, {"q": "name a colour", "a": "red"}]
    ds = prepared(tmp_path, home, rows, "data.packing=false", "data.instruction_template=Q: {q} A: {a} extra",
                  "data.prompt_field=q", "data.response_field=a", "data.add_eos=false")
    assert examples(ds) == [by_hand(tok, "Q: translate A: ", "hello world extra", eos=False),
                            by_hand(tok, "Q: name a colour A: ", "red extra", eos=False)]


def test_packed_instruction_rows_equal_the_unpacked_examples(tmp_path, home):
    """Packed whole (the default), each example's inputs and labels are the unpacked example's, its positions
    restart at 0, and no example straddles two rows."""
    rows = ROWS * 3
    unpacked = prepared(tmp_path, home, rows, "data.packing=false", seq=48)
    packed = prepared(tmp_path, home, rows, seq=48)
    lengths = (unpacked.offsets[1:] - unpacked.offsets[:-1]).tolist()
    assert max(lengths) <= 49 < sum(lengths[:2])
    batch = packed.batch(0, len(packed), 1)
    example = 0
    for r in range(len(packed)):
        first, last = int(packed.rows[r]), int(packed.rows[r + 1])
        at = 0
        for e in range(first, last):
            assert e == example
            end = min(at + lengths[e], 48)
            u_inputs, u_labels, _ = unpacked.row(e)
            assert batch.input_ids[r, 0, at:end].tolist() == u_inputs[:end - at].tolist()
            assert batch.labels[r, 0, at:end].tolist() == u_labels[:end - at].tolist()
            assert batch.positions[r, 0, at:end].tolist() == list(range(end - at))
            at += lengths[e]
            example += 1
        assert at <= 49 and (batch.labels[r, 0, at:] == IGNORE_INDEX).all()
    assert example == len(rows)


def test_a_bad_row_or_template_is_one_line(tmp_path, home):
    with pytest.raises(DataError, match=r"data\.jsonl row 2: field 'output' \(data\.response_field\) is missing; "
                                        r"the row has: instruction$"):
        prepared(tmp_path, home, [ROWS[0], {"instruction": "x"}])
    with pytest.raises(DataError, match=r"data\.jsonl row 1: field 'input' \(data\.input_field\) is list, not text$"):
        prepared(tmp_path, home, [{"instruction": "x", "input": ["a"], "output": "x"}])
    with pytest.raises(DataError, match=r"^data\.instruction_template: a literal template must hold \{output\} "
                                        r"\(data\.response_field\) where the response"):
        prepared(tmp_path, home, ROWS, "data.instruction_template=alpacca")


@pytest.mark.parametrize("template, message", [
    ("Q: {instruction:999999999} A: {output}", r"its format spec '999999999' asks for 999999999 characters"),
    ("Q: {instruction:.999999999} A: {output}", r"its format spec '\.999999999' asks for 999999999 characters"),
    ("Q: {instruction:>99999999999999999999999999} A: {output}", r"its format spec '>9999999999999999999999"),
    ("Q: {instruction:300}{instruction:300} A: {output}", r"the text it renders is longer"),
])
def test_a_format_width_beyond_the_bound_is_one_line(tmp_path, home, template, message):
    """A width or precision (also one filled in from the row) is checked before str.format makes it: one line
    naming the row, the template's key and data.template_max_chars, never a MemoryError."""
    with pytest.raises(DataError) as err:
        prepared(tmp_path, home, ROWS, "data.packing=false", f"data.instruction_template={template}",
                 "data.template_max_chars=500")
    assert re.fullmatch(rf"{tmp_path / 'data.jsonl'} row 1: data\.instruction_template renders past "
                        rf"data\.template_max_chars=500: {message}.*; shorten the template or raise "
                        rf"data\.template_max_chars", str(err.value)), str(err.value)


def test_a_huge_format_width_is_refused_at_the_default_bound(tmp_path, home):
    with pytest.raises(DataError, match=r"row 1: data\.instruction_template renders past data\.template_max_chars="
                                        r"16,777,216: its format spec '999999999' asks for 999999999 characters"):
        prepared(tmp_path, home, [ROWS[0]], "data.instruction_template=Q: {instruction:999999999} A: {output}")


@pytest.mark.parametrize("override, message", [
    ("data.truncation=chop", "data.truncation"),
    ("data.prompt_field=output", "data.response_field: and data.prompt_field are both 'output'"),
    ("data.messages_field=''", "data.messages_field: must name a field of the rows, got ''"),
])
def test_the_new_keys_bad_values_are_one_line(tmp_path, capsys, home, override, message):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n")
    code, _, err = run_cli(capsys, "train", "--config", "tiny", f"data.path={path}", "data.format=instruction",
                           f"data.tokenizer={home}", override, f"output_dir={tmp_path / 'run'}")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_whole_examples_without_packing_is_one_line(tmp_path, capsys):
    code, _, err = run_cli(capsys, "train", "--config", "tiny", "data.packing=false", "data.whole_examples=true",
                           f"output_dir={tmp_path / 'run'}")
    assert code == 2 and err.startswith("ipuft: error: data.whole_examples: packs examples whole into rows, but "
                                        "data.packing=false")
