"""Preference data (``data.format=preference``, #40): TRL's three row forms tokenized as the module says, exact
ids and labels; truncation, dropping and refusal; one line for each bad row; pairs kept whole in micro-batches
under every layout; the config rules of a preference run."""

from __future__ import annotations

import json

import pytest
import torch
from llama_reference import save_hf

from ipuft.components import IGNORE_INDEX
from ipuft.config import load_config
from ipuft.data.tokens import data_source
from ipuft.errors import ConfigError, DataError

SEQ = 12
# Roles as words of the test tokenizer (w10 the user, w11 the assistant); each turn ends with </s>.
TEMPLATE = ("{% for m in messages %}{{ '<s> w10 ' if m.role == 'user' else '<s> w11 ' }}{{ m.content }} </s> "
            "{% endfor %}{% if add_generation_prompt %}<s> w11 {% endif %}")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return save_hf(tmp_path_factory.mktemp("pref-data") / "llama", "llama", seed=1)[1]


def dataset(hooks, src, tmp_path, rows, *extra, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f"model.hf_checkpoint={src}", f"model.sequence_length={SEQ}", f"data.path={path}",
                             "data.format=preference", "data.shuffle=false", "training.global_batch_size=4",
                             "execution.micro_batch_size=2", f"data.chat_template={TEMPLATE}", *extra],
                      hooks.registrations.config_sections)
    return data_source(cfg)


def example(data, row):
    """Row ``row``'s tokens up to its padding and its trained labels' positions."""
    ids, labels = data.row(row)
    trained = (labels != IGNORE_INDEX).nonzero().flatten().tolist()
    return ids.tolist(), labels, trained


def test_text_rows_end_each_completion_with_eos_and_train_only_it(hooks, src, tmp_path):
    data = dataset(hooks, src, tmp_path, [{"prompt": "w5 w6 w7", "chosen": "w8 w9", "rejected": "w20"}])
    assert len(data) == 2 and data.pairs == 1
    ids, labels, trained = example(data, 0)
    assert ids[:6] == [5, 6, 7, 8, 9, 2] and ids[6:] == [0] * (SEQ - 6)  # eos (config.json's 2) ends it
    assert trained == [2, 3, 4] and labels[2:5].tolist() == [8, 9, 2]  # the completion's tokens, predicted
    ids, labels, trained = example(data, 1)
    assert ids[:5] == [5, 6, 7, 20, 2] and trained == [2, 3] and labels[2:4].tolist() == [20, 2]


def test_conversational_rows_render_through_the_chat_template(hooks, src, tmp_path):
    """The prompt with the generation prompt, each completion what the whole conversation adds after it, as
    jinja2 renders the same template here."""
    import jinja2
    from tokenizers import Tokenizer

    prompt = [{"role": "user", "content": "w5 w6"}]
    chosen, rejected = [{"role": "assistant", "content": "w7 w8"}], [{"role": "assistant", "content": "w9"}]
    data = dataset(hooks, src, tmp_path, [{"prompt": prompt, "chosen": chosen, "rejected": rejected}])
    template = jinja2.Environment().from_string(TEMPLATE)
    tokenizer = Tokenizer.from_file(str(src / "tokenizer.json"))
    head = template.render(messages=prompt, add_generation_prompt=True)
    for row, answer in ((0, chosen), (1, rejected)):
        whole = template.render(messages=prompt + answer, add_generation_prompt=False)
        want = tokenizer.encode(head, add_special_tokens=False).ids + \
            tokenizer.encode(whole[len(head):], add_special_tokens=False).ids
        ids, labels, trained = example(data, row)
        assert ids[:len(want)] == want and want[:7] == [1, 10, 5, 6, 2, 1, 11]
        assert trained == list(range(6, len(want) - 1)) and labels[trained[-1]] == 2  # the turn's </s> trained


def test_pretokenized_rows_are_taken_as_they_are(hooks, src, tmp_path):
    data = dataset(hooks, src, tmp_path, [{"prompt_input_ids": [7, 8], "chosen_input_ids": [9, 10, 11],
                                           "rejected_input_ids": [12]}])
    ids, labels, trained = example(data, 0)
    assert ids[:5] == [7, 8, 9, 10, 11] and trained == [1, 2, 3] and labels[1:4].tolist() == [9, 10, 11]
    ids, _, trained = example(data, 1)
    assert ids[:3] == [7, 8, 12] and ids[3:] == [0] * (SEQ - 3) and trained == [1]


LONG = {"prompt_input_ids": list(range(3, 11)), "chosen_input_ids": list(range(20, 28)), "rejected_input_ids": [30]}


def test_truncation_keeps_the_prompt_and_cuts_the_completion(hooks, src, tmp_path, capsys):
    data = dataset(hooks, src, tmp_path, [LONG])  # 8 + 8 tokens in a row of 13: the chosen cut to 5
    ids, _, trained = example(data, 0)
    assert ids == list(range(3, 11)) + [20, 21, 22, 23] and trained == list(range(7, 12))
    assert "1 of 1 pairs are longer than model.sequence_length + 1 and their completions were cut" in \
        capsys.readouterr().err
    kept = dataset(hooks, src, tmp_path, [LONG], "data.max_prompt_tokens=3")  # the prompt's last 3 tokens
    ids, _, trained = example(kept, 0)
    assert ids[:11] == [8, 9, 10, *range(20, 28)] and trained == list(range(2, 10))


def test_drop_leaves_a_long_pair_out_and_error_refuses_it(hooks, src, tmp_path, capsys):
    short = {"prompt_input_ids": [5], "chosen_input_ids": [6], "rejected_input_ids": [7]}
    data = dataset(hooks, src, tmp_path, [LONG, short], "data.truncation=drop")
    assert data.pairs == 1 and example(data, 0)[0][:2] == [5, 6]
    assert "1 of 2 pairs are longer than model.sequence_length + 1 and were left out" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"pairs.jsonl row 1: the pair has 16 tokens, longer than "
                                        r"model.sequence_length \+ 1 = 13; set data.truncation=truncate or drop$"):
        dataset(hooks, src, tmp_path, [LONG], "data.truncation=error")


BAD = [
    ({"prompt": "w5", "chosen": "w6"}, r"field 'rejected' is missing"),
    ({"prompt_input_ids": [5], "chosen_input_ids": [6]}, r"field 'rejected_input_ids' is missing"),
    ({"text": "w5"}, r"field 'prompt' is missing .* the row has: text"),
    ({"prompt": "w5", "chosen": "", "rejected": "w6"}, r"chosen is an empty completion"),
    ({"prompt_input_ids": [5], "chosen_input_ids": [], "rejected_input_ids": [6]},
     r"chosen_input_ids is an empty completion"),
    ({"prompt": "w5", "chosen": "w6 w7", "rejected": "w6 w7"}, r"chosen and rejected are the same tokens"),
    ({"prompt_input_ids": [5], "chosen_input_ids": [6, 101], "rejected_input_ids": [7]},
     r"chosen_input_ids: token id 101 is outside the model's vocabulary \(model.embedding.vocab_size = 101\)"),
    ({"prompt_input_ids": [-1], "chosen_input_ids": [6], "rejected_input_ids": [7]},
     r"prompt_input_ids: token id -1 is outside"),
    ({"prompt_input_ids": list(range(3, 16)), "chosen_input_ids": [6], "rejected_input_ids": [7]},
     r"prompt_input_ids has 13 tokens, leaving no room for a completion"),
    ({"prompt_input_ids": [], "chosen_input_ids": [6], "rejected_input_ids": [7]}, r"prompt_input_ids is empty"),
    ({"prompt_input_ids": "5 6", "chosen_input_ids": [6], "rejected_input_ids": [7]},
     r"prompt_input_ids must be a list of integer token ids"),
    ({"prompt": "w5", "chosen": ["w6"], "rejected": "w7"}, r"prompt, chosen and rejected must all be text or all message lists"),
    ({"prompt": [{"role": "user", "content": "w5"}], "chosen": [{"role": "robot", "content": "w6"}],
      "rejected": [{"role": "assistant", "content": "w7"}]}, r"chosen\[0\]: role 'robot' is not one of"),
]


@pytest.mark.parametrize("row,message", BAD, ids=[m[:30] for _, m in BAD])
def test_a_bad_row_is_one_line_naming_the_row_and_the_field(hooks, src, tmp_path, row, message):
    good = {"prompt_input_ids": [5], "chosen_input_ids": [6], "rejected_input_ids": [7]}
    with pytest.raises(DataError, match=r"^\S*pairs.jsonl row 2: " + message) as info:
        dataset(hooks, src, tmp_path, [good, row])
    assert "\n" not in str(info.value)


def pairs(count: int) -> list[dict]:
    return [{"prompt_input_ids": [3 + k], "chosen_input_ids": [50 + k], "rejected_input_ids": [80 + k]}
            for k in range(count)]


def test_batches_keep_each_pair_in_one_micro_batch_under_every_layout(hooks, src, tmp_path):
    """Rows 2i and 2i + 1 of each micro-batch are one pair's chosen and rejected; batch sizes count rows; DP ranks
    take alternate micro-batches of whole pairs; the same step gives the same rows; the reference is each row's."""
    data = dataset(hooks, src, tmp_path, pairs(6), "data.shuffle=true")
    assert len(data) == 12 and data.pairs == 6
    data.reference = torch.arange(12, dtype=torch.float32)
    whole = data.batch(1, 8, 2)
    assert whole.input_ids.shape == (4, 2, SEQ) and whole.reference.shape == (4, 2)
    prompt, first = whole.input_ids[..., 0], whole.input_ids[..., 1]
    assert torch.equal(prompt[:, 0], prompt[:, 1])  # one prompt each micro-batch
    assert ((first[:, 0] - prompt[:, 0]) == 47).all() and ((first[:, 1] - prompt[:, 0]) == 77).all()
    assert torch.equal(whole.reference, 2 * (prompt - 3).float() + torch.tensor([0.0, 1.0]))
    ranks = [data.batch(1, 8, 2, rank, 2) for rank in range(2)]
    assert torch.equal(torch.stack([r.input_ids for r in ranks], 1).flatten(0, 1), whole.input_ids)
    assert torch.equal(data.batch(1, 8, 2).input_ids, whole.input_ids)
    seen = torch.cat([data.batch(s, 4, 2).input_ids[..., 0].flatten() for s in range(3)])
    assert sorted(seen[0::2].tolist()) == list(range(3, 9))  # one epoch: every pair once
    rows = torch.cat([b.input_ids[0, :, :2] for b in data.eval_batches(4)])
    assert rows[:, 0].tolist() == [3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8] and rows[1::2, 1].tolist() == list(range(80, 86))


def test_a_split_holds_out_whole_pairs_and_a_fingerprint_tells_a_change(hooks, src, tmp_path):
    data = dataset(hooks, src, tmp_path, pairs(6), "data.validation_fraction=0.34")
    held = data.held_out
    assert (data.pairs, held.pairs) == (4, 2)
    kept = {int(b.input_ids[0, 0, 0]) for b in data.eval_batches(2)}
    out = {int(b.input_ids[0, 0, 0]) for b in held.eval_batches(2)}
    assert kept | out == set(range(3, 9)) and not kept & out
    changed = pairs(6)
    changed[5]["rejected_input_ids"] = [99]
    a = dataset(hooks, src, tmp_path, pairs(6))
    assert a.fingerprint() == dataset(hooks, src, tmp_path, pairs(6), name="again.jsonl").fingerprint()
    assert a.fingerprint() != dataset(hooks, src, tmp_path, changed).fingerprint()


@pytest.mark.parametrize("override,message", [
    ("execution.micro_batch_size=3", r"^execution.micro_batch_size: is 3, but data.format=preference counts rows"),
    ("training.preference.beta=0", r"^training.preference.beta: must be a finite number > 0, got 0"),
    ("training.preference.sft_weight=-1", r"^training.preference.sft_weight: must be a finite number >= 0"),
    ("training.preference.simpo_gamma=inf", r"^training.preference.simpo_gamma: must be a finite number"),
    ("data.max_prompt_tokens=0", r"^data.max_prompt_tokens: must be null or a number of tokens >= 1, got 0"),
    ("training.preference.loss=kto", r"training.preference.loss"),
])
def test_the_config_rules_of_a_preference_run(hooks, src, override, message):
    base = [f"model.hf_checkpoint={src}", "data.format=preference", "training.global_batch_size=12",
            "execution.micro_batch_size=2"]
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*base, override], hooks.registrations.config_sections)


def test_trls_implicit_prompt_is_the_conversations_common_start(hooks, src, tmp_path):
    """Conversations that begin with the same messages (TRL's implicit prompt; UltraFeedback's binarized rows,
    whose text prompt is then unused) give the explicit form's ids; sharing no first message is one line."""
    user = {"role": "user", "content": "w5 w6"}
    chosen, rejected = {"role": "assistant", "content": "w7 w8"}, {"role": "assistant", "content": "w9"}
    explicit = dataset(hooks, src, tmp_path, [{"prompt": [user], "chosen": [chosen], "rejected": [rejected]}])
    for row in ({"chosen": [user, chosen], "rejected": [user, rejected]},
                {"prompt": "w5 w6", "chosen": [user, chosen], "rejected": [user, rejected]}):
        implicit = dataset(hooks, src, tmp_path, [row], name="implicit.jsonl")
        for k in range(2):
            assert torch.equal(implicit.row(k)[0], explicit.row(k)[0]) and torch.equal(implicit.row(k)[1],
                                                                                      explicit.row(k)[1])
    with pytest.raises(DataError, match=r"row 1: chosen and rejected are conversations that share no first message"):
        dataset(hooks, src, tmp_path, [{"chosen": [chosen], "rejected": [rejected]}])
