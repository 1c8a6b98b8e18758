"""``ipuft eval`` and ``ipuft generate`` against transformers on the same checkpoint."""

import json
import shutil
from importlib import resources

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import run_cli as cli
from hf_reference import hf_gptj

from ipuft import parallel
from ipuft.config import load_config

SAMPLE_TOKENIZER = resources.files("ipuft.sample_data") / "tokenizer.json"




@pytest.fixture
def hf_dir(tmp_path):
    """A random tiny GPT-J with the shipped 512-token tokenizer, as a Hugging Face directory."""
    cfg = load_config("tiny", ["model.embedding.vocab_size=512", "model.sequence_length=32"])
    model = hf_gptj(cfg, seed=5)
    out = tmp_path / "hf"
    model.save_pretrained(out)
    shutil.copyfile(str(SAMPLE_TOKENIZER), out / "tokenizer.json")
    return model, out


@pytest.mark.parametrize("chunk", [0, 7])
def test_eval_loss_equals_transformers_on_a_tokens_file(capsys, tmp_path, hf_dir, chunk, monkeypatch):
    """Whole logits, or the head's loss by chunks of 7 tokens as training takes it (the logits of a micro-batch
    over Llama 3's vocabulary are GiBs): the same loss as transformers'."""
    calls, chunked = [], parallel.chunked_head_loss
    monkeypatch.setattr(parallel, "chunked_head_loss", lambda *a, **k: calls.append(a[0].shape[0]) or chunked(*a, **k))
    model, src = hf_dir
    rows = torch.randint(0, 512, (5, 33), generator=torch.Generator().manual_seed(0))
    data = tmp_path / "tokens.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r.tolist()}) + "\n" for r in rows))
    code, out, err = cli(capsys, "eval", "--config", "tiny", f"model.hf_checkpoint={src}", "model.sequence_length=32",
                         "model.embedding.vocab_size=512",
                         f"data.path={data}", "data.format=tokens", "execution.micro_batch_size=2",
                         f"execution.head_chunk_tokens={chunk}", "--json")
    assert code == 0, err
    assert calls == ([64, 64, 32] if chunk else [])  # each micro-batch's tokens, by chunks inside
    result = json.loads(out)
    with torch.no_grad():
        logits = model(rows[:, :-1]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()
    assert result["tokens"] == 5 * 32
    assert abs(result["loss"] - expected) <= 1e-5
    assert result["perplexity"] == pytest.approx(torch.tensor(expected).exp().item(), rel=1e-5)


def test_generate_cli_equals_transformers_greedy(capsys, hf_dir):
    model, src = hf_dir
    from ipuft.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(src))
    prompt = "mnli hypothesis: the dog runs premise: a dog is running target:"
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False).ids])
    code, out, err = cli(capsys, "generate", "--checkpoint", str(src), "--max-new-tokens", "6", prompt)
    assert code == 0, err
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    new = theirs[0, ids.shape[1]:].tolist()
    if 0 in new:  # ipuft stops at <|endoftext|> (id 0), inclusive
        new = new[: new.index(0) + 1]
    assert out == prompt + tokenizer.decode(new, skip_special_tokens=False) + "\n"
    # KEY=VALUE overrides after the prompt: the same model, run in bfloat16, continues the prompt too.
    code, out16, err = cli(capsys, "generate", "--checkpoint", str(src), "--max-new-tokens", "6", prompt,
                           "model.precision=bfloat16", "execution.device=cpu")
    assert code == 0, err
    assert out16.startswith(prompt) and len(out16) > len(prompt) + 1


@pytest.mark.slow
def test_mnli_accuracy_matches_transformers_generation(capsys, tmp_path):
    """Train briefly on the shipped MNLI sample, then MNLI accuracy by ipuft equals that of transformers'
    greedy generation on the exported model."""
    run = tmp_path / "run"
    # Unpacked, the loss covers only the label after "target:", so a few steps teach it.
    base = ["--config", "tiny", "data.path=mnli-sample", "data.tokenizer=sample", "model.embedding.vocab_size=512",
            "model.sequence_length=80", "data.packing=false"]
    code, _, err = cli(capsys, "train", *base, "training.steps=40", "training.global_batch_size=8",
                       "training.optimizer.learning_rate.maximum=3e-3", f"output_dir={run}")
    assert code == 0, err
    rows = (resources.files("ipuft.sample_data") / "mnli_sample.jsonl").read_text().splitlines()[:24]
    subset = tmp_path / "val.jsonl"
    subset.write_text("\n".join(rows) + "\n")
    code, out, err = cli(capsys, "eval", "--checkpoint", str(run), f"data.path={subset}", "--task", "mnli",
                         "--mode", "generate", "--json")
    assert code == 0, err
    ours = json.loads(out)
    assert ours["examples"] == 24 and ours["mode"] == "generate"
    # One row at a time decodes the same labels as batches of 8 rows of different lengths.
    code, out, err = cli(capsys, "eval", "--checkpoint", str(run), f"data.path={subset}", "--task", "mnli",
                         "--mode", "generate", "--batch-size", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["correct"] == ours["correct"]

    code, _, err = cli(capsys, "export", "--checkpoint", str(run), "--hf", str(tmp_path / "hf"))
    assert code == 0, err
    from transformers import GPTJForCausalLM

    from ipuft.data.templates import resolve_template
    from ipuft.data.tokenizer import load_tokenizer

    model = GPTJForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = load_tokenizer(str(tmp_path / "hf"))
    template = resolve_template("mnli")
    correct = 0
    for i, line in enumerate(rows):
        prompt, target = template.render(json.loads(line), f"row {i}")
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False).ids])
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=0, pad_token_id=0)
        text = tokenizer.decode(new[0, ids.shape[1]:].tolist(), skip_special_tokens=False)
        correct += text.replace("<|endoftext|>", "").strip() == target.replace("<|endoftext|>", "").strip()
    assert ours["correct"] == correct
    assert ours["accuracy"] > 0.6  # the brief training learned the labels


def test_mnli_score_mode_equals_transformers_log_likelihoods(capsys, make_config, hooks, tmp_path):
    """--mode score: the sum of each label text's token log-probabilities after the prompt, as transformers
    computes them on the same weights; the label with the highest one is the prediction."""
    from hf_reference import hf_runner

    from ipuft.data.templates import resolve_template
    from ipuft.data.tokenizer import load_tokenizer
    from ipuft.run.evaluate import label_log_likelihoods

    cfg = make_config("model.embedding.vocab_size=512", "model.sequence_length=64")
    model = hf_gptj(cfg, seed=5)
    src = tmp_path / "hf"
    model.save_pretrained(src)
    shutil.copyfile(str(SAMPLE_TOKENIZER), src / "tokenizer.json")
    tokenizer = load_tokenizer(str(src))
    template = resolve_template("mnli")
    rows = [json.loads(line) for line in
            (resources.files("ipuft.sample_data") / "mnli_sample.jsonl").read_text().splitlines()[:12]]
    prompts = [tokenizer.encode(template.render(r, "row")[0], add_special_tokens=False).ids for r in rows]
    labels = [template.labels[k] for k in sorted(template.labels)]
    candidates = [tokenizer.encode(template.target.format(label=name), add_special_tokens=False).ids for name in labels]
    assert len({len(p) for p in prompts}) > 1  # rows of different lengths: padding is exercised
    ours = label_log_likelihoods(hf_runner(cfg, hooks, model.state_dict()), prompts, candidates)
    for prompt, scores in zip(prompts, ours, strict=True):
        for candidate, score in zip(candidates, scores, strict=True):
            ids = torch.tensor([prompt + candidate])
            with torch.no_grad():
                log_probs = model(ids).logits[0].log_softmax(-1)
            theirs = sum(log_probs[len(prompt) - 1 + j, t].item() for j, t in enumerate(candidate))
            assert abs(score - theirs) <= 1e-4 * max(1.0, abs(theirs))

    # The command: the same predictions, batched or one row at a time.
    subset = src.parent / "val.jsonl"
    subset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = sum(labels[max(range(3), key=s.__getitem__)] == template.render(r, "row")[1].replace(
        "<|endoftext|>", "").strip() for s, r in zip(ours, rows))
    for batch in ("5", "1"):
        code, out, err = cli(capsys, "eval", "--config", "tiny", f"model.hf_checkpoint={src}",
                             "model.embedding.vocab_size=512", "model.sequence_length=64", f"data.path={subset}",
                             "--task", "mnli", "--batch-size", batch, "--json")
        assert code == 0, err
        result = json.loads(out)
        assert result["mode"] == "score" and result["examples"] == 12 and result["correct"] == expected
        assert result["tokens_per_s"] > 0 and result["device_peak_bytes"] > 0
