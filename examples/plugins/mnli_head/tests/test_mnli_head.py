"""The MNLI classification head: installed through a real entry point (``ipuft.testing``'s ``install_plugin``),
its loss and gradients against plain autograd, the whole engine against a plain reference, training through
the command line (accuracy on the shipped sample improves), tensor parallelism, and its errors."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ipuft.components import IGNORE_INDEX
from ipuft.config import load_config
from ipuft.errors import DataError
from ipuft.testing import assert_parity, max_rel

SOURCE = Path(__file__).resolve().parents[1]  # examples/plugins/mnli_head: importable when not pip-installed
SAMPLE_IDS = (347, 349, 350)  # " entailment", " neutral", " contradiction" in the shipped sample tokenizer
# The shipped sample, one example per row: its longest row is 72 tokens, its vocabulary 512.
MNLI = ("model.head=mnli_classifier", "data.path=mnli-sample", "data.tokenizer=sample", "data.packing=false",
        "model.sequence_length=72", "model.embedding.vocab_size=512")


@pytest.fixture
def hooks(install_plugin):
    return install_plugin("ipuft_mnli_head", name="mnli_head", path=SOURCE)


@pytest.fixture(autouse=True)
def _cache_in_tmp(monkeypatch, tmp_path_factory):
    """The tokenized-data cache of every test (and of the processes it starts) lives in a temporary folder."""
    monkeypatch.setenv("IPUFT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "token-cache"))


def mnli_labels(classes, positions, length, ids=SAMPLE_IDS):
    """Labels as the unpacked mnli template gives them: the label token at each row's position, then
    end-of-text (id 0), IGNORE_INDEX elsewhere."""
    labels = torch.full((len(classes), length), IGNORE_INDEX)
    for row, (c, p) in enumerate(zip(classes, positions)):
        labels[row, p], labels[row, p + 1] = ids[c], 0
    return labels


def reference_loss(hidden, labels, w, ids=SAMPLE_IDS, eps=1e-5):
    """The head written out: each row's first labelled position, layer norm, projection, log-softmax."""
    losses = []
    for row in range(hidden.shape[0]):
        p = next(t for t in range(labels.shape[1]) if labels[row, t] != IGNORE_INDEX)
        h = hidden[row, p]
        h = (h - h.mean()) / torch.sqrt(((h - h.mean()) ** 2).mean() + eps) * w["norm.weight"] + w["norm.bias"]
        logits = w["proj.weight"] @ h + w["proj.bias"]
        log_probs = logits - torch.logsumexp(logits, 0)
        losses.append(-log_probs[ids.index(int(labels[row, p]))])
    return torch.stack(losses).mean()


def random_head(hidden_size, seed=0):
    from ipuft_mnli_head.module import MNLIClassifier

    head = MNLIClassifier(hidden_size, SAMPLE_IDS)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-trivial norms and biases, so that no term can hide
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return head


def test_loss_and_every_gradient_equal_plain_autograd(hooks):
    head = random_head(16)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 9, 16, generator=g, requires_grad=True)
    labels = mnli_labels([0, 2, 1, 1, 0], [3, 7, 0, 5, 6], 9)
    loss = head(hidden, labels)
    loss.backward()

    weights = {n: p.detach().clone().requires_grad_() for n, p in head.named_parameters()}
    ref_hidden = hidden.detach().clone().requires_grad_()
    expected = reference_loss(ref_hidden, labels, weights)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-6 * expected.item()
    assert max_rel(hidden.grad, ref_hidden.grad) <= 1e-6
    assert hidden.grad[:, [1, 2, 4, 8]].abs().sum() == 0  # only each row's label position is read
    for name, p in head.named_parameters():
        assert max_rel(p.grad, weights[name].grad) <= 1e-6, name


def test_without_labels_every_position_has_three_logits(hooks):
    head = random_head(16)
    hidden = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(2))
    logits = head(hidden)
    assert logits.shape == (2, 4, 3)
    w = dict(head.named_parameters())
    expected = torch.nn.functional.layer_norm(hidden, (16,), w["norm.weight"], w["norm.bias"]) @ w["proj.weight"].T
    assert max_rel(logits, expected + w["proj.bias"]) <= 1e-6


def adam_by_hand(beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.1):
    """ipuft's adamw written out, over Hugging Face names (the head's own, which has none: ``head.*``)."""
    m, v = {}, {}

    def update(name, p, g, lr, t):
        m[name] = beta1 * m.get(name, 0) + (1 - beta1) * g
        v[name] = beta2 * v.get(name, 0) + (1 - beta2) * g * g
        u = (m[name] / (1 - beta1**t)) / ((v[name] / (1 - beta2**t)).sqrt() + eps)
        if not (name.endswith("bias") or ".ln_" in name or name.startswith("head.norm")):
            u = u + weight_decay * p
        p -= lr * u

    return update


def test_five_steps_through_the_engine_equal_a_plain_reference(hooks):
    """Embeddings, decoder layers and this head, trained on the shipped sample with GA=4, a loss scale and
    clipping, against the same modules run one micro-batch at a time by plain autograd."""
    overrides = [*MNLI, "training.global_batch_size=8", "execution.micro_batch_size=2", "execution.loss_scaling=64",
                 "training.optimizer.gradient_clipping=0.5", "training.optimizer.learning_rate.maximum=3e-3",
                 "plugins.adamw.weight_decay=0.1", "plugins.adamw.eps=1e-4"]
    parity = assert_parity(hooks, overrides, adam_by_hand(eps=1e-4), steps=5, rtol=1e-5)
    assert {n for n in parity.weights if n.startswith("head.")} == {"head.norm.weight", "head.norm.bias",
                                                                     "head.proj.weight", "head.proj.bias"}
    assert abs(parity.losses[0] - math.log(3)) < 0.1  # three classes, a fresh head
    assert min(parity.reference_grad_norms) > 0.5  # clipping is active on every step


def test_training_through_the_command_line_improves_accuracy_on_the_sample(hooks, tmp_path, capsys):
    from ipuft.cli.main import main
    from ipuft.config import checkpoint_config
    from ipuft.data.tokens import data_source
    from ipuft.run.runtime import inference_engine
    from ipuft_mnli_head.module import accuracy

    run = tmp_path / "run"
    args = ["train", "--config", "tiny", *MNLI, "training.steps=40", "training.global_batch_size=16",
            "execution.micro_batch_size=8", "training.optimizer.learning_rate.maximum=3e-3", f"output_dir={run}"]
    with pytest.raises(SystemExit) as info:
        main(args)
        raise SystemExit(0)
    assert info.value.code in (0, None), capsys.readouterr().err
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert abs(losses[0] - math.log(3)) < 0.15 and last < 0.8 * first, losses

    sections = hooks.registrations.config_sections
    single = ["execution.micro_batch_size=50", "training.global_batch_size=50"]
    trained = checkpoint_config(run, sections, single)
    fresh = load_config("tiny", [*MNLI, *single], sections)
    rows = data_source(fresh)
    before = accuracy(inference_engine(fresh, hooks), rows, 50)
    after = accuracy(inference_engine(trained, hooks), rows, 50)
    assert before["rows"] == after["rows"] == 300
    assert before["accuracy"] < 0.45 and after["accuracy"] > before["accuracy"] + 0.2, (before, after)

    # Text generation and label scoring by likelihood need vocabulary logits: one line, not garbage text or a
    # traceback; the loss task works with this head.
    line = ("ipuft: error: model.head: mnli_classifier gives 3 scores per position, not logits over the 512-token "
            "vocabulary; generating text and scoring labels by their likelihood need a language-model head (ipuft "
            "eval's loss task works with any head)\n")
    capsys.readouterr()
    mnli = ["eval", "--checkpoint", str(run), "data.path=mnli-sample", "--task", "mnli"]
    for command in (["generate", "--checkpoint", str(run), "hello"], mnli, [*mnli, "--mode", "generate"]):
        with pytest.raises(SystemExit) as info:
            main(command)
        assert info.value.code == 2 and capsys.readouterr().err == line, command
    with pytest.raises(SystemExit) as info:
        main(["eval", "--checkpoint", str(run), "data.path=mnli-sample", "--json"])
        raise SystemExit(0)
    assert info.value.code in (0, None)
    assert json.loads(capsys.readouterr().out)["loss"] < math.log(3)


def test_tensor_parallel_training_equals_one_process(hooks, tmp_path):
    """The replicated head under TP=2 (torchrun, two Gloo ranks): the same losses and final weights as one
    process, so its input gradient reaches the vocabulary- and head-sharded units whole."""
    from safetensors.torch import load_file

    from ipuft.run.train import train

    # Adam divides by √v + eps, so near eps it amplifies float32 rounding in tiny gradients (the summation
    # order differs across layouts); eps=1e-4 keeps the comparison about the layout.
    common = [*MNLI, "training.steps=3", "training.global_batch_size=4", "execution.micro_batch_size=2",
              "training.optimizer.learning_rate.maximum=3e-3", "plugins.adamw.eps=1e-4", "execution.device=cpu"]
    cfg = load_config("tiny", [*common, f"output_dir={tmp_path}/tp1"], hooks.registrations.config_sections)
    single = [r["loss"] for r in train(cfg, hooks, progress=False)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "ipuft.cli.main", "train", "--config", "tiny", *common, "execution.tensor_parallel=2",
               f"output_dir={tmp_path}/tp2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    parallel = [json.loads(line)["loss"] for line in (tmp_path / "tp2" / "metrics.jsonl").read_text().splitlines()]
    assert len(parallel) == 3
    for a, b in zip(parallel, single, strict=True):
        assert abs(a - b) <= 1e-5 * b
    weights = {run: load_file(next((tmp_path / run / "checkpoints").glob("step-*")) / "model.safetensors")
               for run in ("tp1", "tp2")}
    assert weights["tp1"].keys() == weights["tp2"].keys()
    for name, w in weights["tp1"].items():
        assert max_rel(weights["tp2"][name], w) <= 1e-5, name


def test_plan_measures_the_head_on_the_meta_device_and_equals_the_counters(hooks, capsys):
    """``ipuft plan`` runs every component on the meta device (no values): the head's checks must not need
    them, and the planned traffic and device peak bound are what a step then moves."""
    from ipuft.cli.main import main
    from ipuft.data.tokens import data_source
    from ipuft.plan.estimate import estimate
    from ipuft.run.runtime import build_engine

    with pytest.raises(SystemExit) as info:
        main(["plan", "--config", "tiny", *MNLI, "--json"])
        raise SystemExit(0)
    out, err = capsys.readouterr()
    assert info.value.code in (0, None), err
    assert json.loads(out)["device_peak_bytes"] > 0
    cfg = load_config("tiny", [*MNLI, "training.global_batch_size=4"], hooks.registrations.config_sections)
    engine = build_engine(cfg, hooks)
    planned = estimate(cfg, engine.parts, hooks)
    result = engine.step(data_source(cfg).batch(0, 4, 1), 1e-3)
    assert result.traffic == planned["traffic"]
    assert result.device_peak_bytes <= planned["device_peak_bytes"]


def test_label_token_ids_come_from_the_tokenizer_or_the_config(hooks):
    from ipuft_mnli_head import label_token_ids

    sections = hooks.registrations.config_sections
    assert label_token_ids(load_config("tiny", list(MNLI), sections)) == SAMPLE_IDS
    cfg = load_config("tiny", [*MNLI, "plugins.mnli_head.label_token_ids=[5,6,7]"], sections)
    assert label_token_ids(cfg) == (5, 6, 7)


@pytest.mark.parametrize(("overrides", "line"), [
    ([*MNLI, "data.packing=true"],
     "model.head: mnli_classifier reads one example per row, at its label; set data.packing=false"),
    ([*MNLI, "plugins.mnli_head.label_token_ids=[5,5,7]"],
     "plugins.mnli_head.label_token_ids: must be 3 distinct token ids in [0, 512) (entailment, neutral, "
     "contradiction), got [5, 5, 7]"),
    ([*MNLI, "plugins.mnli_head.label_token_ids=[1,2]"],
     "plugins.mnli_head.label_token_ids: must be 3 distinct token ids in [0, 512) (entailment, neutral, "
     "contradiction), got [1, 2]"),
    (["model.head=mnli_classifier"],
     "plugins.mnli_head.label_token_ids: the run has no tokenizer, so the label tokens cannot be derived; set "
     "the 3 token ids that start the targets of entailment, neutral and contradiction"),
    (["plugins.mnli_head.label_token_ids=[1,2,3]"],
     "plugins.mnli_head.label_token_ids (used when model.head=mnli_classifier): it is set but does nothing in "
     "this config; drop it or select what it configures"),
])
def test_bad_settings_are_one_line(hooks, capsys, overrides, line):
    from ipuft.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["plan", "--config", "tiny", *overrides])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"ipuft: error: {line}\n"


def test_a_row_labelled_with_another_token_is_one_data_error(hooks):
    head = random_head(8)
    labels = mnli_labels([0, 1], [2, 4], 7)
    labels[1, 4] = 99
    with pytest.raises(DataError, match=r"^mnli_classifier: row 1 of a micro-batch is labelled with token 99 first, "
                                        r"not one of the label tokens \[347, 349, 350\]; .*label_token_ids\)$"):
        head(torch.zeros(2, 7, 8), labels)


def test_not_exported_and_the_entry_point_module_imports_no_torch(hooks):
    from ipuft_mnli_head.module import MNLIClassifier

    assert MNLIClassifier.hf_exportable is False
    assert random_head(8).hf_mapping(None) == {}
    code = "import sys, ipuft_mnli_head; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
