"""Chat data (data.format=chat): the loss masks of ChatML- and Llama-3-style templates against masks written out
by hand, the generation-marker masks against transformers' return_assistant_tokens_mask, packing whole examples,
data.truncation, hostile rows and templates, and generate --chat."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import run_cli
from llama_reference import GEMMA3_TEMPLATE, GEMMA_TEMPLATE

from ipuft.components import IGNORE_INDEX
from ipuft.config import load_config
from ipuft.data.chat import ChatTemplate, check_messages, load_chat_template
from ipuft.data.tokenizer import load_tokenizer
from ipuft.data.tokens import TokenDataset
from ipuft.errors import DataError

tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|endoftext|>"]
GEMMA_SPECIALS = ["<start_of_turn>", "<end_of_turn>"]  # after WORDS: the others' ids stay as they were
WORDS = ["system", "user", "assistant", "You", "are", "kind", ".", "hi", "there", "how", "are", "you", "fine", "thanks", "what", "is", "two", "plus", "two", "four", "bye", "see", "later", "ok", "sure"]

# Qwen2's ChatML template, shortened: a default system message, then each turn as <|im_start|>ROLE\n...<|im_end|>\n.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are kind .<|im_end|>\\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama 3's template, as its tokenizer_config.json has it.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
          "{% endif %}")
# ChatML with generation markers around each assistant turn's text and end of turn.
MARKED = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hi"},
     {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine thanks"}],
    [{"role": "system", "content": "You are kind ."}, {"role": "user", "content": "what is two plus two"},
     {"role": "assistant", "content": "four"}],
    [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "see you later"},
     {"role": "user", "content": "ok"}],
]


def word_tokenizer(directory, template=None, bos="<|begin_of_text|>", eos="<|im_end|>"):
    """A word-level tokenizer (whitespace splits words; the specials are tokens of their own) saved with a
    tokenizer_config.json naming its bos, eos and chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS + GEMMA_SPECIALS + ["model"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIALS + GEMMA_SPECIALS)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"bos_token": bos, "eos_token": eos, "unk_token": "<unk>"}
    if template is not None:
        settings["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(path, tokenizer_dir, *overrides, seq=64):
    return load_config("tiny", [f"data.path={path}", f"data.tokenizer={tokenizer_dir}", "data.format=chat",
                                "data.cache=false", "data.shuffle=false", f"model.sequence_length={seq}",
                                "model.embedding.vocab_size=64", *overrides])


def dataset(tmp_path, template, conversations=CONVERSATIONS, *overrides, seq=64, field="messages"):
    home = word_tokenizer(tmp_path / "tok", template)
    path = write_jsonl(tmp_path / "chat.jsonl", [{field: c} for c in conversations])
    cfg = config(path, home, *overrides, seq=seq)
    return TokenDataset.from_config(cfg, load_tokenizer(str(home))), load_tokenizer(str(home))


def by_hand(tok, segments):
    """Ids and mask of ``segments`` ``[(text, in_loss), ...]`` encoded one by one; checked to equal the whole
    text's encoding, so the mask is exactly the segments' token by token."""
    ids, mask = [], []
    for text, in_loss in segments:
        part = tok.encode(text, add_special_tokens=False).ids
        ids += part
        mask += [int(in_loss)] * len(part)
    assert ids == tok.encode("".join(t for t, _ in segments), add_special_tokens=False).ids
    return ids, mask


def examples(ds):
    """Each example of an unpacked or whole-packed dataset as (ids, mask)."""
    return [(ds.tokens[a:b].tolist(), ds.mask[a:b].tolist()) for a, b in zip(ds.offsets, ds.offsets[1:])]


def chatml_segments(conversation):
    head = [] if conversation[0]["role"] == "system" else [("<|im_start|>system\nYou are kind .<|im_end|>\n", 0)]
    out = head
    for m in conversation:
        if m["role"] == "assistant":
            out += [("<|im_start|>assistant\n", 0), (m["content"] + "<|im_end|>\n", 1)]
        else:
            out += [(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", 0)]
    return out


def llama3_segments(conversation):
    out = [("<|begin_of_text|>", 0)]
    for m in conversation:
        out += [(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", 0), (m["content"] + "<|eot_id|>",
                                                                              m["role"] == "assistant")]
    return out


def gemma_segments(conversation):
    out = [("<|begin_of_text|>", 0)]  # the template's bos_token: the tokenizer's
    for m in conversation:
        if m["role"] == "assistant":
            out += [("<start_of_turn>model\n", 0), (m["content"] + "<end_of_turn>\n", 1)]
        else:
            out += [(f"<start_of_turn>{m['role']}\n{m['content']}<end_of_turn>\n", 0)]
    return out


def test_gemmas_template_trains_its_model_turns_and_refuses_a_system_turn(tmp_path):
    """Gemma 2's template (no system role, the assistant named "model"): its model turns' text and end of turn
    are in the loss, as written by hand; a conversation with a system turn is one line naming its row and the
    template's own words."""
    conversations = [CONVERSATIONS[0], CONVERSATIONS[2]]  # user first, roles alternating, no system turn
    ds, tok = dataset(tmp_path / "ok", GEMMA_TEMPLATE, conversations, "data.packing=false")
    assert examples(ds) == [by_hand(tok, gemma_segments(c)) for c in conversations]
    home = word_tokenizer(tmp_path / "tok", GEMMA_TEMPLATE)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}, {"messages": CONVERSATIONS[1]}])
    with pytest.raises(DataError) as err:
        TokenDataset.from_config(config(path, home), load_tokenizer(str(home)))
    assert str(err.value) == (f"{path} row 2: the chat template ({home / 'tokenizer_config.json'}'s chat_template) "
                              f"refuses it: System role not supported")


def gemma3_segments(conversation):
    prefix = ""
    if conversation[0]["role"] == "system":  # no turn of its own: it opens the first user turn
        prefix, conversation = conversation[0]["content"] + "\n\n", conversation[1:]
    out = [("<|begin_of_text|>", 0)]
    for i, m in enumerate(conversation):
        if m["role"] == "assistant":
            out += [("<start_of_turn>model\n", 0), (m["content"] + "<end_of_turn>\n", 1)]
        else:
            out += [(f"<start_of_turn>{m['role']}\n{prefix if i == 0 else ''}{m['content']}<end_of_turn>\n", 0)]
    return out


def test_gemma3s_template_opens_the_first_user_turn_with_the_system_turn(tmp_path):
    """Gemma 3's template takes a system turn, as the first user turn's opening text: that text is in the
    example and out of the loss with the rest of the user's turn; the model turns are trained as Gemma 2's."""
    ds, tok = dataset(tmp_path, GEMMA3_TEMPLATE, CONVERSATIONS, "data.packing=false")
    expected = [by_hand(tok, gemma3_segments(c)) for c in CONVERSATIONS]
    assert examples(ds) == expected
    system = tok.encode("You are kind .", add_special_tokens=False).ids
    ids, mask = expected[1]
    at = next(i for i in range(len(ids)) if ids[i:i + len(system)] == system)
    assert ids[at - 2:at] == tok.encode("<start_of_turn>user", add_special_tokens=False).ids
    assert not any(mask[:at + len(system)]) and sum(mask) == 2  # "four" and its <end_of_turn>


@pytest.mark.parametrize("template, segments", [(CHATML, chatml_segments), (LLAMA3, llama3_segments)],
                         ids=["chatml", "llama3"])
def test_chat_masks_equal_masks_written_by_hand(tmp_path, template, segments):
    """Without markers, each assistant turn (its text and end of turn, not its header) is in the loss; the
    system, user turns and headers are not. The conversation without an assistant turn is no example."""
    ds, tok = dataset(tmp_path, template, CONVERSATIONS[:2] + [CONVERSATIONS[2][:1]], "data.packing=false")
    expected = [by_hand(tok, segments(c)) for c in CONVERSATIONS[:2]]
    assert examples(ds) == expected
    # The labels of row 0: the next token where it is the assistant's, else ignored.
    ids, mask = expected[0]
    labels = [i if m else IGNORE_INDEX for i, m in zip(ids[1:], mask[1:])]
    labels += [IGNORE_INDEX] * (64 - len(labels))
    assert ds.row(0)[1].tolist() == labels and ds.row(0)[2] is None


def test_generation_markers_equal_transformers_assistant_mask(tmp_path):
    """With {% generation %} markers the mask is the marked text's tokens, as transformers computes it, here on a
    byte-level BPE whose tokens straddle the markers' edges (a leading space, merged words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    conversations = CONVERSATIONS + [[{"role": "user", "content": "sure?"},
                                      {"role": "assistant", "content": " ok, sure. \n bye"}]]
    tok.train_from_iterator([" ".join(m["content"] for m in c) for c in conversations] * 3, trainer)
    home = tmp_path / "bpe"
    home.mkdir()
    tok.save(str(home / "tokenizer.json"))
    (home / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": MARKED}))
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations])
    ds = TokenDataset.from_config(load_config("tiny", [
        f"data.path={path}", f"data.tokenizer={home}", "data.format=chat", "data.cache=false", "data.shuffle=false",
        "data.packing=false", "model.sequence_length=80", "model.embedding.vocab_size=300"]), load_tokenizer(str(home)))
    reference = PreTrainedTokenizerFast(tokenizer_file=str(home / "tokenizer.json"), eos_token="<|im_end|>")
    reference.chat_template = MARKED
    got = examples(ds)
    for conversation, (ids, mask) in zip(conversations, got, strict=True):
        out = reference.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        assert ids == list(out["input_ids"])
        assert mask == list(out["assistant_masks"]), [(reference.decode([i]), m, r) for i, m, r in
                                                      zip(ids, mask, out["assistant_masks"])]
    assert sum(sum(m) for _, m in got) > 10


def test_markers_and_prefix_rendering_agree(tmp_path):
    """The marked ChatML template and the unmarked one with the same turns give the same masks, but for the newline
    after each end of turn, which only the unmarked one puts in the loss."""
    marked, _ = dataset(tmp_path / "a", MARKED)
    plain = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
             "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    unmarked, _ = dataset(tmp_path / "b", plain)
    assert examples(marked) == examples(unmarked)  # a newline is no token of the word-level tokenizer


# -- Packing whole examples ---------------------------------------------------------------------------------------


def test_packed_chat_rows_hold_whole_examples_with_restarting_positions(tmp_path):
    """Packed (data.packing=true, whole examples by default), no example straddles two rows, each row's positions
    restart at 0 at each example, and each example's inputs and labels are the unpacked example's."""
    conversations = (CONVERSATIONS[:2] * 4)[:7]
    unpacked, _ = dataset(tmp_path / "u", CHATML, conversations, "data.packing=false", seq=47)
    packed, _ = dataset(tmp_path / "p", CHATML, conversations, seq=47)
    lengths = (unpacked.offsets[1:] - unpacked.offsets[:-1]).tolist()
    assert len(packed) < len(unpacked) and packed.rows is not None
    batch = packed.batch(0, len(packed), 1)
    assert batch.positions.shape == batch.input_ids.shape == (len(packed), 1, 47)
    assert batch.positions.dtype == torch.int64
    example = 0
    for r in range(len(packed)):
        inputs, labels, positions = (t[r, 0] for t in (batch.input_ids, batch.labels, batch.positions))
        at = 0
        while example < len(lengths) and at + lengths[example] <= 48:
            length = lengths[example]
            u_inputs, u_labels, _ = unpacked.row(example)
            end = min(at + length, 47)
            assert torch.equal(inputs[at:end], u_inputs[:end - at])
            assert torch.equal(labels[at:end], u_labels[:end - at])
            assert positions[at:end].tolist() == list(range(end - at))
            at += length
            example += 1
        assert (labels[at:] == IGNORE_INDEX).all()  # the rest of the row is padding
        if at < 47:
            assert positions[at] == 0
    assert example == len(lengths)
    # Greedy fill: a row ends only where its next example would not fit.
    rows = packed.rows.tolist()
    for r in range(len(rows) - 2):
        assert sum(lengths[rows[r]:rows[r + 1]]) + lengths[rows[r + 1]] > 48


def test_chunked_chat_keeps_masks_and_has_no_positions(tmp_path):
    """data.whole_examples=false: concatenated and cut as text is, the assistant masks kept, no positions."""
    unpacked, _ = dataset(tmp_path / "u", CHATML, CONVERSATIONS[:2] * 3, "data.packing=false", seq=40)
    chunked, _ = dataset(tmp_path / "c", CHATML, CONVERSATIONS[:2] * 3, "data.whole_examples=false", seq=9)
    stream_ids = [i for ids, _ in examples(unpacked) for i in ids]
    stream_mask = [m for _, mask in examples(unpacked) for m in mask]
    batch = chunked.batch(0, len(chunked), 1)
    assert batch.positions is None
    for r in range(len(chunked)):
        chunk = stream_ids[r * 10:(r + 1) * 10]
        keep = stream_mask[r * 10 + 1:(r + 1) * 10]
        assert batch.input_ids[r, 0].tolist() == chunk[:-1]
        assert batch.labels[r, 0].tolist() == [i if m else IGNORE_INDEX for i, m in zip(chunk[1:], keep)]


def test_text_packed_whole_on_request(tmp_path):
    """data.format=text keeps concatenating by default (positions None); data.whole_examples=true packs each
    document whole, every token of it in the loss but its first, positions restarting at each document."""
    home = word_tokenizer(tmp_path / "tok", None, eos="<|endoftext|>")
    docs = ["hi there how are you", "fine thanks", "what is two plus two four", "bye"]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    tok = load_tokenizer(str(home))
    common = ["data.format=text", "data.cache=false", "data.shuffle=false", f"data.path={path}",
              f"data.tokenizer={home}", "model.sequence_length=8", "model.embedding.vocab_size=64"]
    assert TokenDataset.from_config(load_config("tiny", common), tok).batch(0, 1, 1).positions is None
    ds = TokenDataset.from_config(load_config("tiny", [*common, "data.whole_examples=true"]), tok)
    encoded = [tok.encode(d).ids + [tok.token_to_id("<|endoftext|>")] for d in docs]
    assert [len(e) for e in encoded] == [6, 3, 7, 2] and ds.rows.tolist() == [0, 2, 4]  # rows of 9 tokens
    batch = ds.batch(0, 2, 1)
    assert batch.positions[:, 0].tolist() == [[0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 3, 4, 5, 6, 0]]
    assert batch.input_ids[:, 0].tolist() == [(encoded[0] + encoded[1])[:8], (encoded[2] + encoded[3])[:8]]
    # Label k - 1 is token k, kept unless token k starts a document (token 6 of row 0, token 7 of row 1).
    expected = [[t if k != 6 else IGNORE_INDEX for k, t in enumerate(encoded[0] + encoded[1]) if k],
                [t if k != 7 else IGNORE_INDEX for k, t in enumerate(encoded[2] + encoded[3]) if k]]
    assert batch.labels[:, 0].tolist() == expected


# -- Truncation ---------------------------------------------------------------------------------------------------


def test_truncation_error_drop_and_truncate(tmp_path, capsys):
    """An example longer than sequence_length + 1: one line naming it (error), left out and counted once (drop),
    or cut to its first tokens with their mask (truncate, the chat default)."""
    full, _ = dataset(tmp_path / "f", CHATML, CONVERSATIONS[:2], "data.packing=false", seq=64)
    (long_ids, long_mask), short = examples(full)
    width = len(long_ids) - 3
    assert len(short[0]) <= width
    with pytest.raises(DataError) as err:
        dataset(tmp_path / "e", CHATML, CONVERSATIONS[:2], "data.packing=false", "data.truncation=error", seq=width - 1)
    assert str(err.value) == (f"{tmp_path / 'e' / 'chat.jsonl'} row 1: {len(long_ids)} tokens, longer than "
                              f"model.sequence_length + 1 = {width}; shorten it, or set data.truncation=truncate "
                              f"or drop")
    capsys.readouterr()
    dropped, _ = dataset(tmp_path / "d", CHATML, CONVERSATIONS[:2], "data.packing=false", "data.truncation=drop",
                         seq=width - 1)
    assert examples(dropped) == [short]
    assert capsys.readouterr().err == (f"ipuft: note: {tmp_path / 'd' / 'chat.jsonl'}: 1 of 2 examples "
                                       f"({len(long_ids)} tokens) are longer than model.sequence_length + 1 = "
                                       f"{width} tokens and were left out (data.truncation=drop); "
                                       f"data.truncation=truncate keeps their first tokens\n")
    for overrides in (["data.packing=false"], []):  # the default, unpacked and packed whole
        cut, _ = dataset(tmp_path / f"t{len(overrides)}", CHATML, CONVERSATIONS[:2], *overrides, seq=width - 1)
        assert examples(cut) == [(long_ids[:width], long_mask[:width]), short]
        assert "truncated to their first tokens (data.truncation=truncate)" in capsys.readouterr().err


# -- Hostile rows and templates -----------------------------------------------------------------------------------


@pytest.mark.parametrize("row, message", [
    ({"messages": "hi"}, "field 'messages' is str, not a list"),
    ({"text": "hi"}, "field 'messages' is missing"),
    ({"messages": []}, "field 'messages' is an empty list"),
    ({"messages": ["hi"]}, r"messages\[0\] is str, not an object with role and content"),
    ({"messages": [{"role": 3, "content": "hi"}]}, r"messages\[0\]: role is int, not text"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, r"messages\[0\]: role 'tool' is not one of system, user"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, r"messages\[0\]: content is list, not text"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\]: content is missing"),
])
def test_a_bad_row_is_one_line_naming_file_and_row(tmp_path, row, message):
    home = word_tokenizer(tmp_path / "tok", CHATML)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}, row])
    with pytest.raises(DataError, match=rf"^{tmp_path / 'chat.jsonl'} row 2: {message}") as err:
        TokenDataset.from_config(config(path, home), load_tokenizer(str(home)))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("template, message", [
    ("{{ raise_exception('only user and assistant roles') }}", "refuses it: only user and assistant roles"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "refuses it: it loops more than 1,000,000 range"),
    ("{{ messages.__class__.__mro__ }}", "fails: "),
    ("{% set r = range(1) %}{% if r.budget is defined %}{{ r.budget.tick(-10000000) }}{% endif %}{% if r._budget is "
     "defined %}{{ r._budget.tick(-10000000) }}{% endif %}{% for i in range(3000) %}{% for j in range(3000) %}"
     "{% endfor %}{% endfor %}", "refuses it: it loops more than 1,000,000 range"),
    ("{{ 1 / 0 }}", "fails: ZeroDivisionError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "fails: RecursionError"),
    ("{{ cycler.__init__.__globals__.os.system('true') }}", "fails: "),
    ("{% for m in messages %}{{ 'x' * 9000000 }}{% endfor %}", "refuses it: it renders more than 16,777,216 char"),
    ("{{ lipsum(n=10**9) }}", "refuses it: it passes a call the number 1,000,000,000, more than "
                              "data.template_max_chars=16,777,216"),
    ("{{ lipsum(n=100000, max=1000) }}", "refuses it: lipsum would make up to 1,600,000,000, more than"),
    ("{{ 'x' * 10**10 }}", "refuses it: it repeats a value to a length of 10,000,000,000, more than"),
    ("{{ 'x'|center(10**9) }}", "refuses it: its filter center is given 1,000,000,000, more than"),
    ("{{ '{:999999999}'.format(1) }}", "refuses it: its format width is 999999999, more than"),
    ("{{ '%999999999d' % 1 }}", "refuses it: its % format width is 999999999, more than"),
    ("{{ 2 ** 100000000 }}", "refuses it: it raises 2 to the power 100000000"),
    ("{{ 'abc'.__class__ }}{{ [].append }}{% if false %}x{% endif %}", "renders no text for it"),
])
def test_a_template_that_fails_or_loops_is_one_line(tmp_path, template, message):
    home = word_tokenizer(tmp_path / "tok", template)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(DataError) as err:
        TokenDataset.from_config(config(path, home), load_tokenizer(str(home)))
    assert str(err.value).startswith(f"{path} row 1: the chat template ({home / 'tokenizer_config.json'}'s "
                                     f"chat_template) ")
    assert any(m in str(err.value) for m in message.split("|")) and "\n" not in str(err.value)


@pytest.fixture
def _never_hangs():
    """A rendering the deadline fails to stop fails the test (SIGALRM) instead of hanging the suite."""
    import signal

    def stuck(signum, frame):
        raise TimeoutError("the rendering was not stopped by data.template_seconds")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("template", [
    # 2.7e10 loop steps over strings: no range(), no output, nothing a check between chunks would ever see.
    "{% for a in 'x' * 3000 %}{% for b in 'x' * 3000 %}{% for c in 'x' * 3000 %}{% endfor %}{% endfor %}"
    "{% endfor %}hi",
    # One Python call (jinja's own lorem generator, 20000 paragraphs) inside the bound of characters.
    "{{ lipsum(n=20000, max=50)|length }}{{ lipsum(n=20000, max=50)|length }}" * 50,
])
def test_a_chat_template_that_runs_on_is_stopped_by_its_deadline(tmp_path, _never_hangs, template):
    """data.template_seconds interrupts the rendering wherever it is (a loop that prints nothing, inside a
    function the template calls): one line naming the row, the template and the key, soon after the bound."""
    import time

    home = word_tokenizer(tmp_path / "tok", template)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    start = time.monotonic()
    with pytest.raises(DataError) as err:
        TokenDataset.from_config(config(path, home, "data.template_seconds=0.3"), load_tokenizer(str(home)))
    took = time.monotonic() - start
    assert str(err.value) == (f"{path} row 1: the chat template ({home / 'tokenizer_config.json'}'s chat_template) "
                              f"refuses it: it renders one conversation for more than 0.3 s (data.template_seconds)")
    assert took < 5, took
    # The same real template renders afterwards: no interruption is left pending for the thread.
    real = ChatTemplate(CHATML, "data.chat_template")
    assert real.render(CONVERSATIONS[0], False, "row")[0].startswith("<|im_start|>system")
    time.sleep(0.1)


def test_the_render_bounds_are_keys(tmp_path):
    """data.template_max_chars bounds what one rendering yields (a conversation that is within the default is
    refused under a smaller one); both keys refuse nonsense in one line."""
    home = word_tokenizer(tmp_path / "tok", CHATML)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(DataError, match=r"row 1: .* refuses it: it renders more than 40 characters of one "
                                        r"conversation \(data\.template_max_chars\)$"):
        TokenDataset.from_config(config(path, home, "data.template_max_chars=40"), load_tokenizer(str(home)))
    from ipuft.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data\.template_seconds.*must be in \(0, 3600\] seconds, got 0"):
        config(path, home, "data.template_seconds=0")
    with pytest.raises(ConfigError, match=r"data\.template_max_chars.*must be a positive number"):
        config(path, home, "data.template_max_chars=0")


def test_a_template_too_large_or_not_jinja_is_one_line(tmp_path):
    with pytest.raises(DataError, match=r"^data\.chat_template: the chat template has 1,048,577 characters"):
        ChatTemplate("x" * (1 << 20 | 1), "data.chat_template")
    with pytest.raises(DataError, match=r"^data\.chat_template: not a valid Jinja chat template \(line 1\): "):
        ChatTemplate("{% for m in messages %}", "data.chat_template")
    with pytest.raises(DataError, match=r"is neither a Jinja template .* nor an existing file$"):
        load_chat_template("no-such-template.jinja", None, "data.tokenizer")
    with pytest.raises(DataError, match=rf"^data\.chat_template: {tmp_path} is a directory, not a regular file$"):
        load_chat_template(str(tmp_path), None, "data.tokenizer")
    (tmp_path / "big.jinja").write_text("{{ x }}" * 200000)
    with pytest.raises(DataError, match=r"^data\.chat_template .*big\.jinja: the chat template has 1,400,000 char"):
        load_chat_template(str(tmp_path / "big.jinja"), None, "data.tokenizer")
    (tmp_path / "big.jinja").write_text("{{ x }}" * 700000)  # past the bytes read at all
    with pytest.raises(DataError, match=r"^data\.chat_template: .*big\.jinja is larger than 4194304 bytes; a chat"):
        load_chat_template(str(tmp_path / "big.jinja"), None, "data.tokenizer")


def test_a_chat_file_without_a_template_says_what_to_set(tmp_path, capsys):
    home = word_tokenizer(tmp_path / "tok", None)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(DataError) as err:
        TokenDataset.from_config(config(path, home), load_tokenizer(str(home)))
    assert str(err.value) == (f"data.format=chat: data.tokenizer ({home}) has no chat template (no "
                              f"chat_template.jinja, no chat_template in tokenizer_config.json); set "
                              f"data.chat_template to a Jinja template or a file holding one")
    code, _, err_text = run_cli(capsys, "train", "--config", "tiny", f"data.path={path}", f"data.tokenizer={home}",
                                "data.format=chat", "model.embedding.vocab_size=64", f"output_dir={tmp_path / 'run'}")
    assert code == 2 and err_text.strip().endswith("set data.chat_template to a Jinja template or a file holding one")


def test_the_template_sources_and_overrides(tmp_path):
    """chat_template.jinja is taken before tokenizer_config.json's; the list form's "default"; data.chat_template,
    a literal or a file, overrides both; the special tokens come from tokenizer_config.json either way."""
    home = word_tokenizer(tmp_path / "tok", [{"name": "tool_use", "template": "T"},
                                             {"name": "default", "template": "{{ bos_token }}D"}])
    assert load_chat_template(None, home, "k").render([], False, "x")[0] == "<|begin_of_text|>D"
    (home / "chat_template.jinja").write_text("J{{ eos_token }}")
    assert load_chat_template(None, home, "k").render([], False, "x")[0] == "J<|im_end|>"
    (tmp_path / "mine.jinja").write_text("F{{ messages | tojson }}")
    rendered = load_chat_template(str(tmp_path / "mine.jinja"), home, "k").render(
        [{"role": "user", "content": "<é>"}], False, "x")[0]
    assert rendered == 'F[{"role": "user", "content": "<é>"}]'  # transformers' tojson: no HTML escapes
    assert load_chat_template("{{ 'L' }}{{ strftime_now('%Y') | length }}", home, "k").render([], False, "x")[0] == "L4"
    (home / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "a", "template": "A"}]}))
    (home / "chat_template.jinja").unlink()
    with pytest.raises(DataError, match=r"chat_template names templates \(a\) but no \"default\""):
        load_chat_template(None, home, "k")
    (home / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(DataError, match=r"tokenizer_config\.json: chat_template is int, neither a template nor a list"):
        load_chat_template(None, home, "k")


def test_check_messages_keeps_role_and_content():
    assert check_messages([{"role": "user", "content": "a", "name": "x"}], "w") == [{"role": "user", "content": "a"}]


# -- generate --chat ------------------------------------------------------------------------------------------------


GENERATE_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|> {% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Llama with a ChatML-style word-level tokenizer (<|im_end|> is id 2, config.json's eos)."""
    from llama_reference import save_hf

    directory = tmp_path_factory.mktemp("chat-model")
    save_hf(directory, "llama", tokenizer="chatml")
    (directory / "chat_template.jinja").write_text(GENERATE_TEMPLATE)
    return directory


def generated(capsys, directory, *args):
    code, out, err = run_cli(capsys, "generate", "--checkpoint", str(directory), "--chat", "--json", *args)
    assert code == 0, err
    return json.loads(out)


def test_generate_chat_renders_the_generation_prompt_and_stops_at_the_end_of_turn(chat_model, capsys):
    """The prompt is the user message rendered with the generation prompt; a reply stops at generation_config.json's
    eos ids too, and the completion is the reply alone."""
    from ipuft.plugins import create_plugin_manager
    from ipuft.run.generate import chat_prompts, chat_stops, inference_config

    hooks = create_plugin_manager()
    cfg = inference_config(str(chat_model), hooks)
    tok = load_tokenizer(str(chat_model))
    assert chat_prompts(cfg, tok, ["w5 w6", [{"role": "user", "content": "w7"}]]) == [
        tok.encode("<|im_start|>user w5 w6<|im_end|> <|im_start|>assistant ", add_special_tokens=False).ids,
        tok.encode("<|im_start|>user w7<|im_end|> <|im_start|>assistant ", add_special_tokens=False).ids]
    free = generated(capsys, chat_model, "w5 w6", "--max-new-tokens", "8")
    words = free["completions"][0].split()
    ids = [tok.token_to_id(w) for w in words]
    assert free["new_tokens"] == len(words) == 8 and 2 not in ids
    stop = next(k for k in range(1, 8) if ids[k] not in ids[:k])  # a token the reply reaches for the first time
    (chat_model / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[stop], 2]}))
    assert set(chat_stops(cfg, tok, chat_model)) == {2, ids[stop]}  # tokenizer_config's <|im_end|>, the config's
    stopped = generated(capsys, chat_model, "w5 w6", "--max-new-tokens", "8")
    assert stopped["completions"] == [" ".join(words[:stop + 1])] and stopped["new_tokens"] == stop + 1
    (chat_model / "generation_config.json").unlink()
    # The end of turn tokenizer_config.json names (its eos_token) stops a reply as well.
    settings = (chat_model / "tokenizer_config.json").read_text()
    (chat_model / "tokenizer_config.json").write_text(json.dumps({**json.loads(settings), "eos_token": words[stop]}))
    try:
        stopped = generated(capsys, chat_model, "w5 w6", "--max-new-tokens", "8")
    finally:
        (chat_model / "tokenizer_config.json").write_text(settings)
    assert stopped["completions"] == [" ".join(words[:stop + 1])] and stopped["new_tokens"] == stop + 1


def test_generate_chat_with_gemmas_template(capsys, tmp_path):
    """A Gemma 2 directory: the prompt ends in its generation prompt (<start_of_turn>model), a reply stops at
    generation_config.json's <end_of_turn> as well as <eos>, and a system turn is refused in one line."""
    from llama_reference import save_hf

    from ipuft.plugins import create_plugin_manager
    from ipuft.run.generate import chat_prompts, chat_stops, inference_config

    directory = tmp_path / "gemma"
    save_hf(directory, "gemma2", tokenizer="gemma", bos_token_id=2, eos_token_id=1)
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": [1, 4]}))
    cfg = inference_config(str(directory), create_plugin_manager())
    tok = load_tokenizer(str(directory))
    assert chat_prompts(cfg, tok, ["w5  w6 "]) == [tok.encode(
        "<bos><start_of_turn>user\nw5  w6<end_of_turn>\n<start_of_turn>model\n", add_special_tokens=False).ids]
    assert set(chat_stops(cfg, tok, directory)) == {1, 4}  # <eos>, <end_of_turn>
    reply = generated(capsys, directory, "w5 w6", "--max-new-tokens", "6")
    ids = [tok.token_to_id(w) for w in reply["completions"][0].split()]
    assert 1 <= reply["new_tokens"] <= 6 and not {1, 4} & set(ids[:-1])  # nothing after a stop
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [[{"role": "system", "content": "w5"},
                                                        {"role": "user", "content": "w6"}]])
    code, _, err = run_cli(capsys, "generate", "--checkpoint", str(directory), "--chat", "--prompts", str(prompts))
    assert (code, err) == (2, f"ipuft: error: prompt 1: the chat template ({directory / 'chat_template.jinja'}) "
                              f"refuses it: System role not supported\n")


def test_generate_chat_with_gemma3s_template_folds_the_system_turn(capsys, tmp_path):
    """A Gemma 3 directory (gemma3_text): a system turn opens the first user turn of the prompt, which ends in
    the generation prompt; the conversation generates (a greedy reply, nothing after a stop)."""
    from llama_reference import save_hf

    from ipuft.plugins import create_plugin_manager
    from ipuft.run.generate import chat_prompts, inference_config

    directory = tmp_path / "gemma3"
    save_hf(directory, "gemma3_text", tokenizer="gemma3", bos_token_id=2, eos_token_id=1)
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": [1, 4]}))
    cfg = inference_config(str(directory), create_plugin_manager())
    tok = load_tokenizer(str(directory))
    conversation = [{"role": "system", "content": "w5"}, {"role": "user", "content": "w6 w7"}]
    assert chat_prompts(cfg, tok, [conversation]) == [tok.encode(
        "<bos><start_of_turn>user\nw5\n\nw6 w7<end_of_turn>\n<start_of_turn>model\n", add_special_tokens=False).ids]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [conversation])
    reply = generated(capsys, directory, "--prompts", str(prompts), "--max-new-tokens", "5")
    ids = [tok.token_to_id(w) for w in reply["completions"][0].split()]
    assert 1 <= reply["new_tokens"] <= 5 and not {1, 4} & set(ids[:-1])


def test_generate_chat_takes_a_jsonl_of_conversations(chat_model, capsys, tmp_path):
    prompts = tmp_path / "conversations.jsonl"
    write_jsonl(prompts, [[{"role": "user", "content": "w5 w6"}], {"messages": [{"role": "user", "content": "w5 w6"}]}])
    from_file = generated(capsys, chat_model, "--prompts", str(prompts), "--max-new-tokens", "4")
    alone = generated(capsys, chat_model, "w5 w6", "--max-new-tokens", "4")
    assert from_file["completions"] == alone["completions"] * 2
    write_jsonl(prompts, [[{"role": "robot", "content": "w5"}]])
    code, _, err = run_cli(capsys, "generate", "--checkpoint", str(chat_model), "--chat", "--prompts", str(prompts))
    assert code == 2 and err.strip().endswith("prompt 1: messages[0]: role 'robot' is not one of system, user, "
                                              "assistant")
    (chat_model / "chat_template.jinja").rename(chat_model / "moved.jinja")
    try:
        code, _, err = run_cli(capsys, "generate", "--checkpoint", str(chat_model), "--chat", "w5")
    finally:
        (chat_model / "moved.jinja").rename(chat_model / "chat_template.jinja")
    assert code == 2 and err.strip().endswith(f"generate --chat: --checkpoint ({chat_model}) has no chat template (no "
                                              f"chat_template.jinja, no chat_template in tokenizer_config.json); set "
                                              f"data.chat_template to a Jinja template or a file holding one")


def test_fine_tune_on_chat_data_end_to_end(chat_model, capsys, tmp_path):
    """The README's path: train a Hugging Face directory on a JSONL of messages (packed whole, validated on a
    held-out share), chat with the run's checkpoint, which carries the directory's chat template, and export it
    with that template."""
    rows = [{"messages": [{"role": "user", "content": f"w{5 + i} w6"}, {"role": "assistant", "content": f"w{9 + i}"}]}
            for i in range(12)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    code, _, err = run_cli(capsys, "train", f"model.hf_checkpoint={chat_model}", f"data.path={path}",
                           "data.format=chat", "data.validation_fraction=0.3", "training.eval_steps=2",
                           "training.steps=2", "training.global_batch_size=2", "model.sequence_length=16",
                           f"output_dir={tmp_path / 'run'}")
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("validation_loss" in r for r in records)
    chatted = generated(capsys, tmp_path / "run", "w5 w6", "--max-new-tokens", "3")
    assert chatted["new_tokens"] >= 1 and len(chatted["completions"]) == 1
    code, _, err = run_cli(capsys, "export", "--checkpoint", str(tmp_path / "run"), "--hf", str(tmp_path / "hf"))
    assert code == 0, err
    assert (tmp_path / "hf" / "chat_template.jinja").read_text() == GENERATE_TEMPLATE


def test_the_token_cache_keeps_masks_and_rows(tmp_path, monkeypatch):
    """A second preparation, from the cache (the file is not read again), serves the same rows, masks and positions
    as the first."""
    import ipuft.data.tokens

    first, _ = dataset(tmp_path, CHATML, CONVERSATIONS * 2, "data.cache=true", seq=47)

    def unread(*args):
        raise AssertionError("read again")

    monkeypatch.setattr(ipuft.data.tokens, "read_rows", unread)
    again, _ = dataset(tmp_path, CHATML, CONVERSATIONS * 2, "data.cache=true", seq=47)
    for name in ("tokens", "mask", "offsets", "rows"):
        assert torch.equal(getattr(first, name), getattr(again, name))
    a, b = first.batch(0, len(first), 1), again.batch(0, len(again), 1)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.positions, b.positions)


def test_chat_fine_tune_with_lora_exports_an_adapter_peft_reads(chat_model, capsys, tmp_path):
    """Chat data and LoRA together, as the README puts them: train adapters on a JSONL of messages, export them in
    peft's format; peft on the base gives the merged export's logits, which the adapters moved off the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rows = [{"messages": [{"role": "user", "content": f"w{5 + i} w6"}, {"role": "assistant", "content": f"w{9 + i}"}]}
            for i in range(8)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    code, _, err = run_cli(capsys, "train", f"model.hf_checkpoint={chat_model}", f"data.path={path}",
                           "data.format=chat", "model.precision=float32", "model.adapter=lora", "plugins.lora.targets=[q,k,v,o,gate,up,down]",
                           "training.steps=3", "training.global_batch_size=2", "model.sequence_length=16",
                           "training.optimizer.learning_rate.maximum=1e-2", f"output_dir={tmp_path / 'run'}")
    assert code == 0, err
    for flag, out in (("--adapter", "adapter"), ("--hf", "merged")):
        code, _, err = run_cli(capsys, "export", "--checkpoint", str(tmp_path / "run"), flag, str(tmp_path / out))
        assert code == 0, err
    ids = torch.randint(3, 20, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(chat_model).eval()
        before = base(ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits
    assert (adapted - merged).abs().max() <= 1e-5
    assert (adapted - before).abs().max() > 1e-4
