"""Generate the shipped sample data: ``mnli_sample.jsonl`` and the byte-level BPE ``tokenizer.json``.

The rows are MNLI-style (premise, hypothesis, label) pairs written by this script from small hand-made
vocabularies and sentence patterns; no third-party text is involved. Labels follow MNLI's coding:
0 entailment (the hypothesis simplifies the premise), 1 neutral (it adds something the premise does not
say), 2 contradiction (it negates the premise). The tokenizer is trained on the rows rendered through the
``mnli`` template, so the sample trains with the 512-token vocabulary it defines.

Deterministic: ``python -m ipuft.sample_data.make_sample`` rewrites both files byte for byte.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ipuft.data.templates import TEMPLATES

HERE = Path(__file__).parent
ROWS = 300
VOCAB_SIZE = 512
EOS = "<|endoftext|>"

PEOPLE = ["farmer", "teacher", "doctor", "baker", "pilot", "student", "painter", "nurse", "chef", "sailor",
          "musician", "engineer", "librarian", "gardener", "carpenter", "driver"]
ADJECTIVES = ["old", "young", "tall", "tired", "cheerful", "quiet", "busy", "nervous", "patient", "clever"]
# (past tense, base form, objects it takes)
ACTIONS = [
    ("repaired", "repair", ["the fence", "the bicycle", "the roof", "an old clock"]),
    ("painted", "paint", ["the door", "a portrait", "the kitchen", "a small boat"]),
    ("cooked", "cook", ["a large dinner", "the soup", "fresh pasta", "a spicy stew"]),
    ("read", "read", ["a long novel", "the newspaper", "the letter", "a short poem"]),
    ("sold", "sell", ["the old car", "fresh bread", "a wooden chair", "ripe apples"]),
    ("visited", "visit", ["the museum", "a friend", "the library", "the harbour"]),
    ("cleaned", "clean", ["the windows", "the garage", "the classroom", "the stairs"]),
    ("carried", "carry", ["a heavy box", "the groceries", "a basket of eggs", "the ladder"]),
    ("found", "find", ["a lost key", "a silver coin", "the missing map", "a stray cat"]),
    ("wrote", "write", ["a report", "a song", "a long email", "the shopping list"]),
]
PLACES = ["in the village", "near the river", "at the market", "behind the school", "in the city",
          "by the station", "at home", "on the hill"]
TIMES = ["on Monday morning", "last winter", "before sunrise", "after lunch", "during the storm",
         "on a sunny afternoon", "late at night", "over the weekend"]
REASONS = ["a neighbour asked for help", "there was some free time", "it seemed like a good idea",
           "a friend suggested it", "the boss insisted"]
COMPANIONS = ["a cousin", "two colleagues", "the whole family", "an old friend", "a dog"]
EXTRAS = ["for the first time", "without any help", "in less than an hour", "for a small fee",
          "while whistling a tune"]


def sentence(text: str) -> str:
    return text[0].upper() + text[1:] + "."


def make_row(rng: random.Random, label: int) -> dict:
    """One premise/hypothesis pair whose relation is ``label`` (0 entailment, 1 neutral, 2 contradiction)."""
    person, adjective = rng.choice(PEOPLE), rng.choice(ADJECTIVES)
    past, base, objects = rng.choice(ACTIONS)
    obj, place, time = rng.choice(objects), rng.choice(PLACES), rng.choice(TIMES)
    full, short = f"the {adjective} {person}", f"the {person}"
    premise = sentence(f"{full} {past} {obj} {place} {time}")
    if label == 0:  # a simplification: drop details the premise states
        hypothesis = rng.choice([f"{short} {past} {obj}", f"someone {past} {obj} {place}",
                                 f"a {person} {past} something {time}", f"{full} {past} {obj}"])
    elif label == 1:  # adds information the premise neither states nor rules out
        hypothesis = rng.choice([f"{short} {past} {obj} because {rng.choice(REASONS)}",
                                 f"{short} {past} {obj} with {rng.choice(COMPANIONS)}",
                                 f"{short} {past} {obj} {rng.choice(EXTRAS)}"])
    else:  # negates what the premise states
        hypothesis = rng.choice([f"{short} did not {base} {obj}", f"{short} never {past} anything {time}",
                                 f"nobody {past} {obj} {place}", f"{short} refused to {base} {obj}"])
    return {"premise": premise, "hypothesis": sentence(hypothesis), "label": label}


def make_rows() -> list[dict]:
    rng = random.Random(0)
    labels = [i % 3 for i in range(ROWS)]
    rng.shuffle(labels)
    return [make_row(rng, label) for label in labels]


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """A GPT-2-style byte-level BPE: every byte is a token, so any text encodes; EOS is id 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    assert tokenizer.token_to_id(EOS) == 0
    return tokenizer


def main() -> None:
    rows = make_rows()
    with (HERE / "mnli_sample.jsonl").open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    template = TEMPLATES["mnli"]
    texts = ["".join(template.render(row, f"row {i}")) for i, row in enumerate(rows, 1)]
    train_tokenizer(texts).save(str(HERE / "tokenizer.json"), pretty=False)


if __name__ == "__main__":
    main()
