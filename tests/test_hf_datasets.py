"""Hugging Face datasets as ``data.path`` (``ipuft[datasets]``), offline: a ``save_to_disk`` directory (a lone
dataset, or a DatasetDict with splits), a directory of Parquet shards and a dataset's name found in the local
datasets cache give the same token rows as the same rows from a JSONL file, for the text, chat and tokens
formats; a missing split or subset is one line naming what exists; ``data.validation_split`` scores another
split; the token cache keys a dataset by its fingerprint."""

import json
import socket
from typing import ClassVar

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


def cached(name, subsets):
    """``name`` (``owner/name``) in the local datasets cache as the library leaves a Hub dataset it has loaded
    (``owner___name/<subset>/<version>/<commit>/``: each split's Arrow file and ``dataset_info.json``), for it to
    find offline by name: ``subsets`` maps each subset to its splits' rows."""
    from datasets.builder import Key

    class Hub(datasets.ArrowBasedBuilder):
        BUILDER_CONFIGS: ClassVar[list] = [datasets.BuilderConfig(subset) for subset in subsets]

        def _info(self):
            return datasets.DatasetInfo()

        def _split_generators(self, dl_manager):
            return [datasets.SplitGenerator(name=split, gen_kwargs={"rows": rows})
                    for split, rows in subsets[self.config.name].items()]

        def _generate_tables(self, rows):
            yield Key(0, 0), pa.Table.from_pylist(rows)

    for subset in subsets:
        Hub(cache_dir=str(datasets.config.HF_DATASETS_CACHE), config_name=subset, dataset_name=name.split("/")[-1],
            repo_id=name, hash="0123456789abcdef0123456789abcdef01234567").download_and_prepare()
    return name


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """A Hugging Face home of the test's own, offline by its environment, with ``datasets`` imported before it
    was set (this module's import: the library's flags say online, as in a program that imported it first) and
    every host name lookup refused and recorded: what the test asked of the network, to stay empty."""
    home = tmp_path / "hf"
    for var, value in (("HF_HOME", home), ("HF_DATASETS_CACHE", home / "datasets"), ("HF_HUB_OFFLINE", "1"),
                       ("HF_DATASETS_OFFLINE", "1")):
        monkeypatch.setenv(var, str(value))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.chdir(tmp_path)  # a name is not a directory here
    asked = []

    def refused(host, *args, **kwargs):
        asked.append(host)
        raise OSError(f"no network in tests (asked for {host})")

    monkeypatch.setattr(socket, "getaddrinfo", refused)
    return asked


def arrays(cfg, tokenizer):
    d = TokenDataset.from_config(cfg, tokenizer)
    return [None if t is None else t.clone() for t in (d.tokens, d.mask, d.offsets, d.rows)], len(d)


FORMATS = {
    "text": (TEXTS, ["data.format=text", "data.tokenizer=sample", "model.embedding.vocab_size=512"]),
    "tokens": (TOKENS, ["data.format=tokens", "data.packing=false", "model.embedding.vocab_size=64"]),
    "chat": (CHATS, ["data.format=chat", "model.embedding.vocab_size=64"]),
}


def formatted(tmp_path, hooks, fmt):
    """``fmt``'s rows, its configuration of a ``data.path`` (with more overrides) and its tokenizer."""
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

    return rows, config, tokenizer


def assert_same_rows(got, reference):
    (a_arrays, a_count), (b_arrays, b_count) = got, reference
    assert a_count == b_count > 0
    for a, b in zip(a_arrays, b_arrays):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_saved_dataset_and_a_shard_directory_give_the_jsonl_rows(tmp_path, hooks, fmt):
    rows, config, tokenizer = formatted(tmp_path, hooks, fmt)
    reference = arrays(config(jsonl(tmp_path / "rows.jsonl", rows)), tokenizer)
    for source in (saved(tmp_path / "saved", rows), shards(tmp_path / "shards", rows)):
        assert_same_rows(arrays(config(source), tokenizer), reference)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_cached_dataset_name_gives_the_jsonl_rows(tmp_path, hooks, offline_hub, fmt):
    """``data.path=owner/name`` from the local datasets cache, offline, its subset and split picked: the rows of
    that split of that subset, as a JSONL file of them gives; another subset and another split read theirs."""
    rows, config, tokenizer = formatted(tmp_path, hooks, fmt)
    name = cached(f"someone/{fmt.title()}Rows", {"full": {"train": rows[:1], "test": rows},
                                                  "short": {"train": rows[:2]}})
    assert_same_rows(arrays(config(name, "data.subset=full", "data.split=test"), tokenizer),
                     arrays(config(jsonl(tmp_path / "rows.jsonl", rows)), tokenizer))
    assert_same_rows(arrays(config(name, "data.subset=short"), tokenizer),
                     arrays(config(jsonl(tmp_path / "short.jsonl", rows[:2])), tokenizer))
    assert offline_hub == []


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


def test_a_cached_name_without_the_split_or_subset_is_one_line_naming_those_there_are(tmp_path, hooks,
                                                                                         offline_hub):
    name = cached("someone/SplitRows", {"en": {"train": TEXTS[:5], "test": TEXTS[5:]}, "fr": {"train": TEXTS}})

    def config(*more):
        return load_config("tiny", [f"data.path={name}", "data.format=text", "data.tokenizer=sample",
                                    "model.embedding.vocab_size=512", "model.sequence_length=64", "data.cache=false",
                                    "data.packing=false", *more], hooks.registrations.config_sections)

    assert len(data_source(config("data.subset=en", "data.split=test"))) == 2
    with pytest.raises(DataError, match=r"^data.split: someone/SplitRows has no split 'validation'; "
                                        r"its splits: train, test$"):
        data_source(config("data.subset=en", "data.split=validation"))
    with pytest.raises(DataError, match=r"^data.subset: someone/SplitRows has no subset 'de' in the local datasets "
                                        r"cache; its subsets there: en, fr$"):
        data_source(config("data.subset=de"))
    with pytest.raises(DataError, match=r"^data.subset: someone/SplitRows has several subsets in the local "
                                        r"datasets cache; set data.subset to one of: en, fr$"):
        data_source(config())
    assert offline_hub == []


def test_a_name_not_in_the_local_cache_is_one_line_and_nothing_is_downloaded(tmp_path, hooks, offline_hub):
    cfg = load_config("tiny", ["data.path=nobody/no-such-dataset", "data.format=text", "data.tokenizer=sample",
                               "model.embedding.vocab_size=512", "data.cache=false"],
                      hooks.registrations.config_sections)
    with pytest.raises(DataError, match=r"^data.path: nobody/no-such-dataset is neither a file nor a directory, "
                                        r"and the local datasets cache cannot give it offline .*ipuft never downloads"):
        data_source(cfg)
    assert offline_hub == []
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
