"""Hugging Face datasets as ``data.path`` (``ipuft[datasets]``), offline: a ``save_to_disk`` directory (a lone
dataset, or a DatasetDict with splits) and a directory of Parquet shards give the same token rows as the same
rows from a JSONL file, for the text, chat and tokens formats; a missing split or subset is one line naming
what exists; ``data.validation_split`` scores another split; the token cache keys a dataset by its fingerprint."""

import json

import pytest
import torch

from ipuft.config import load_config
from ipuft.data.tokenizer import load_tokenizer
from ipuft.data.tokens import TokenDataset, data_source, validation_source
from ipuft.errors import DataError

datasets = pytest.importorskip("datasets")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

from test_chat_data import CHATML, CONVERSATIONS, word_tokenizer  # noqa: E402 (after the skips)

TEXTS = [{"text": f"row {i} : the quick brown fox jumps over the lazy dog {i}"} for i in range(7)]
TOKENS = [{"input_ids": list(range(3 + i, 9 + 2 * i))} for i in range(5)]
CHATS = [{"messages": c} for c in CONVERSATIONS]


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def saved(path, rows):
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def shards(path, rows, split="train"):
    path.mkdir(parents=True)
    half = len(rows) // 2
    for k, part in enumerate((rows[:half], rows[half:])):  # two shards, read in name order
        pq.write_table(pa.Table.from_pylist(part), str(path / f"{split}-{k:05d}-of-00002.parquet"))
    return path


def arrays(cfg, tokenizer):
    d = TokenDataset.from_config(cfg, tokenizer)
    return [None if t is None else t.clone() for t in (d.tokens, d.mask, d.offsets, d.rows)], len(d)


FORMATS = {
    "text": (TEXTS, ["data.format=text", "data.tokenizer=sample", "model.embedding.vocab_size=512"]),
    "tokens": (TOKENS, ["data.format=tokens", "data.packing=false", "model.embedding.vocab_size=64"]),
    "chat": (CHATS, ["data.format=chat", "model.embedding.vocab_size=64"]),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_saved_dataset_and_a_shard_directory_give_the_jsonl_rows(tmp_path, hooks, fmt):
    rows, overrides = FORMATS[fmt]
    tokenizer = None
    if fmt == "chat":
        home = word_tokenizer(tmp_path / "tok", CHATML)
        overrides = [*overrides, f"data.tokenizer={home}"]
        tokenizer = load_tokenizer(str(home))
    elif fmt == "text":
        tokenizer = load_tokenizer("sample")

    def config(path, *more):
        return load_config("tiny", [f"data.path={path}", "model.sequence_length=16", "data.cache=false",
                                    *overrides, *more], hooks.registrations.config_sections)

    reference, count = arrays(config(jsonl(tmp_path / "rows.jsonl", rows)), tokenizer)
    assert count > 0
    for source in (saved(tmp_path / "saved", rows), shards(tmp_path / "shards", rows)):
        got, n = arrays(config(source), tokenizer)
        assert n == count
        for a, b in zip(got, reference):
            assert (a is None and b is None) or torch.equal(a, b)


def test_splits_subsets_and_the_validation_split(tmp_path, hooks):
    """A DatasetDict's split by ``data.split``; a missing split names those there are, a subset of a saved
    dataset or of shards is refused in one line; ``data.validation_split`` is another split, scored in order."""
    train, test = TEXTS[:5], TEXTS[5:]
    root = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(root))
    common = ["data.format=text", "data.tokenizer=sample", "model.embedding.vocab_size=512", "model.sequence_length=64",
              "data.cache=false", "data.packing=false"]

    def config(path, *more):
        return load_config("tiny", [f"data.path={path}", *common, *more], hooks.registrations.config_sections)

    assert len(data_source(config(root))) == 5
    assert len(data_source(config(root, "data.split=test"))) == 2
    held = validation_source(config(root, "data.validation_split=test", "training.eval_steps=1"))
    assert len(held) == 2 and held.sampler.shuffle is False
    with pytest.raises(DataError, match=r"^data.split: .*dict has no split 'validation'; its splits: train, test$"):
        data_source(config(root, "data.split=validation"))
    with pytest.raises(DataError, match=r"^data.subset: .* has no subsets; set data.subset=null$"):
        data_source(config(root, "data.subset=en"))
    parts = shards(tmp_path / "shards", TEXTS, "test")
    with pytest.raises(DataError, match=r"^data.split: .*shards has no split 'train'; its splits: test$"):
        data_source(config(parts))
    assert len(data_source(config(parts, "data.split=test"))) == len(TEXTS)


def test_a_name_not_in_the_local_cache_is_one_line_and_nothing_is_downloaded(tmp_path, hooks, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("tiny", ["data.path=nobody/no-such-dataset", "data.format=text", "data.tokenizer=sample",
                               "model.embedding.vocab_size=512", "data.cache=false"],
                      hooks.registrations.config_sections)
    with pytest.raises(DataError, match=r"^data.path: nobody/no-such-dataset is neither a file nor a directory, "
                                        r"and the local datasets cache cannot give it offline .*ipuft never downloads"):
        data_source(cfg)
    # A missing file keeps its own line; a directory that holds no dataset says what it lacks.
    missing = load_config("tiny", ["data.path=gone.jsonl", "data.format=text", "data.tokenizer=sample",
                                   "model.embedding.vocab_size=512"], hooks.registrations.config_sections)
    with pytest.raises(DataError, match=r"^data.path: gone.jsonl does not exist$"):
        data_source(missing)
    (tmp_path / "empty").mkdir()
    empty = load_config("tiny", ["data.path=empty", "data.format=text", "data.tokenizer=sample",
                                 "model.embedding.vocab_size=512"], hooks.registrations.config_sections)
    with pytest.raises(DataError, match=r"^data.path: empty is a directory, but neither a saved dataset"):
        data_source(empty)


def test_the_token_cache_keys_a_dataset_by_its_fingerprint(tmp_path, hooks):
    """A second run reads the cached tokens; the same rows saved again with one row changed are a new entry."""
    common = ["data.format=text", "data.tokenizer=sample", "model.embedding.vocab_size=512", "model.sequence_length=16"]
    first = saved(tmp_path / "a", TEXTS)
    cfg = load_config("tiny", [f"data.path={first}", *common], hooks.registrations.config_sections)
    built = data_source(cfg)
    again = data_source(cfg)
    assert torch.equal(built.tokens, again.tokens)
    from ipuft.paths import cache_root

    entries = sorted(p.name for p in (cache_root() / "tokens").iterdir())
    changed = saved(tmp_path / "b", [*TEXTS[:-1], {"text": "a different last row"}])
    data_source(load_config("tiny", [f"data.path={changed}", *common], hooks.registrations.config_sections))
    assert len(sorted(p.name for p in (cache_root() / "tokens").iterdir())) == len(entries) + 1


def test_without_the_datasets_library_one_line_names_the_extra(tmp_path, hooks, monkeypatch):
    import sys

    path = saved(tmp_path / "a", TEXTS)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    cfg = load_config("tiny", [f"data.path={path}", "data.format=text",
                               "data.tokenizer=sample", "model.embedding.vocab_size=512", "data.cache=false"],
                      hooks.registrations.config_sections)
    with pytest.raises(DataError, match=r"^data.path: reading a Hugging Face dataset needs the datasets library; "
                                        r"pip install ipuft\[datasets\]$"):
        data_source(cfg)
