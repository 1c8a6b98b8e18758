"""The head's weight gradient made one vocabulary slice at a time (``execution.head_vocab_slices``,
ipuft.head_loss and ipuft.engine.sliced) equals the head's gradient made whole: in plain autograd, through the
engine (tied and untied, float32 and bfloat16), on every layout; its slices go to the stored gradients, a tied
table's gradient stays in host memory, the counters equal the plan, and Gemma 3 12B plans within 4 GiB."""

import json

import dist_workers
import pytest
import torch
from distributed import spawn
from test_chunked_head import STEP, head_case, rel
from test_engine import batches, make_engine

from ipuft.errors import ConfigError
from ipuft.head_loss import head_chunks
from ipuft.plan.estimate import estimate

GIB = 2**30


def sliced_loss_and_grads(head, hidden, labels, chunk: int, slices: int, seed: float = 2.0):
    x = hidden.clone().requires_grad_()
    head.zero_grad()
    with head_chunks(chunk, seed, slices):
        loss = head(x, labels)
    (loss * seed).backward()
    return loss.detach(), x.grad, {n: p.grad.clone() for n, p in head.named_parameters()}


@pytest.mark.parametrize("kind", ["gptj", "llama", "gemma2"])
@pytest.mark.parametrize("slices", [2, 3, 50])
def test_sliced_gradients_equal_the_whole_heads(kind, slices):
    """50 vocabulary rows in 2, 3 (17, 17, 16 rows) or 50 slices, 37 tokens in chunks of 8, GPT-J's biased head,
    Llama's and Gemma 2's soft-capped one: the loss and the input's gradient are the same computation (equal),
    the weight's gradient within float32 rounding (its softmax is exp(logits - lse), not exp(log_softmax))."""
    head, hidden, labels = head_case(kind)
    whole = sliced_loss_and_grads(head, hidden, labels, 8, 0)
    sliced = sliced_loss_and_grads(head, hidden, labels, 8, slices)
    assert torch.equal(sliced[0], whole[0]) and torch.equal(sliced[1], whole[1])
    for name, g in whole[2].items():
        assert rel(sliced[2][name], g) <= 1e-6, name


def test_bfloat16_sliced_gradients_are_the_whole_heads():
    """In bfloat16 the slices' logits, softmax and gradient round as the whole head's: bit for bit here."""
    head, hidden, labels = head_case("gemma2")
    head = head.to(torch.bfloat16)
    hidden = hidden.to(torch.bfloat16)
    whole = sliced_loss_and_grads(head, hidden, labels, 8, 0)
    sliced = sliced_loss_and_grads(head, hidden, labels, 8, 3)
    for name, g in whole[2].items():
        assert torch.equal(sliced[2][name], g), name


RECIPES = {"float32": (), "bf16-sr": ("model.precision=bfloat16", "training.stochastic_rounding=true")}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("recipe", RECIPES, ids=list(RECIPES))
def test_an_engine_step_with_a_sliced_head_equals_the_whole(hooks, make_config, tied, recipe):
    """Steps (GA=2, loss scale 8, clipping active) with the head's gradient in 3 slices give the losses, norms
    and weights of the whole head's: three float32 steps within 1e-6 (losses, norms) and 1e-5 (weights); one
    bfloat16 step with stochastic rounding the same loss and norm within 1e-6, and every weight within a
    bfloat16 step of the whole head's run, equal but for at most 0.5% of them (a float32 rounding apart may
    round the other way). A tied table's gradient stays in host memory: its lookups' rows are added where the
    head's slices went."""
    runs = {}
    for slices in (0, 3):
        cfg = make_config(*STEP, *RECIPES[recipe], "execution.head_chunk_tokens=3",
                          f"execution.head_vocab_slices={slices}", f"model.tie_embeddings={tied}")
        engine = make_engine(cfg, hooks)
        steps = 3 if not RECIPES[recipe] else 1  # (16-bit: a rounding apart after one update grows under Adam)
        runs[slices] = [engine.step(batch, 1e-3) for batch in batches(cfg)[:steps]], engine.model.weights()
    assert runs[3][0][0].grad_norm > 0.05  # clipping is active
    for a, b in zip(runs[3][0], runs[0][0], strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-6)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-6)
    for unit, tensors in runs[0][1].items():
        for name, t in tensors.items():
            got = runs[3][1][unit][name]
            if not RECIPES[recipe]:
                assert rel(got, t) <= 1e-5, (unit, name)
                continue
            step = torch.finfo(torch.bfloat16).eps * t.float().abs().clamp_min(2**-126)
            apart = (got.float() - t.float()).abs()
            assert bool((apart <= 2 * step).all()), (unit, name)
            assert int((apart > 0).sum()) <= max(2, t.numel() // 200), (unit, name)


@pytest.mark.parametrize(("tied", "placement"), [(False, "device"), (True, "device"), (False, "host"), (True, "host")])
def test_sliced_counters_equal_the_plan(hooks, make_config, tied, placement):
    """The head's inputs kept in host memory (sent once, brought back once a slice), the slices written into the
    stored gradients and a tied table's lookups sent to host memory are counted as the plan counts them: the
    traffic equal byte for byte; the device peak within the plan's; the head phase's peak below the whole
    head's."""
    peaks = {}
    for slices in (0, 4):
        cfg = make_config("training.global_batch_size=4", "execution.activation_offload=true",
                          f"execution.optimizer_placement={placement}", f"model.tie_embeddings={tied}",
                          "execution.head_chunk_tokens=8", f"execution.head_vocab_slices={slices}",
                          "model.embedding.vocab_size=1024")
        engine = make_engine(cfg, hooks)
        planned = estimate(cfg, engine.parts, hooks)
        for batch in batches(cfg)[:2]:
            result = engine.step(batch, 1e-3)
            assert result.traffic == planned["traffic"]
            assert result.device_peak_bytes <= planned["device_peak_bytes"]
        peaks[slices] = {p["phase"]: p["device"]["compute"] for p in planned["program"]}
        if slices:
            tokens = cfg.execution.micro_batch_size * cfg.model.sequence_length
            stash = cfg.gradient_accumulation * tokens * cfg.model.hidden_size * 4  # the head's inputs, float32
            assert planned["traffic"]["d2h"]["activation"] - stash == estimate(
                make_config("training.global_batch_size=4", "execution.activation_offload=true",
                            f"execution.optimizer_placement={placement}", f"model.tie_embeddings={tied}",
                            "execution.head_chunk_tokens=8", "model.embedding.vocab_size=1024"),
                engine.parts, hooks)["traffic"]["d2h"]["activation"]
    assert peaks[4]["head:loss_backward"] < peaks[0]["head:loss_backward"]


def test_slices_need_a_chunked_head(make_config):
    with pytest.raises(ConfigError, match=r"execution.head_vocab_slices: 4 slices the head's gradient of a loss "
                                          r"computed by chunks of tokens; set execution.head_chunk_tokens above 0"):
        make_config("execution.head_vocab_slices=4", "execution.head_chunk_tokens=0")


def test_sliced_layouts_equal_one_process(hooks, tmp_path):
    """DP=2 (RTS: each slice's mean over DP, each rank keeping its shard's part) and TP=2 (each rank's vocabulary
    block sliced), tied and untied, equal one process with the whole head; every rank's counters equal the
    plan."""
    from test_distributed import COMMON, STEPS, single_process
    from test_distributed import rel as close

    configs = {}
    for tied in (False, True):
        extra = ["execution.head_chunk_tokens=5", "execution.head_vocab_slices=3", f"model.tie_embeddings={tied}"]
        configs[f"dp2_tied{int(tied)}"] = [*COMMON, *extra, "execution.data_parallel=2",
                                           "training.global_batch_size=4", "execution.rts=true"]
        configs[f"tp2_tied{int(tied)}"] = [*COMMON, *extra, "execution.tensor_parallel=2",
                                           "training.global_batch_size=2"]
    for layout in ("dp2", "tp2"):
        chosen = {n: c for n, c in configs.items() if n.startswith(layout)}
        spawn(2, dist_workers.train_configs, chosen, STEPS, str(tmp_path), tmp=tmp_path)
    for name in configs:
        tied = name.endswith("1")
        losses, norms, weights = single_process(hooks, 4 if name.startswith("dp2") else 2,
                                                [f"model.tie_embeddings={tied}"])
        got = torch.load(tmp_path / f"{name}.rank0.pt")
        assert max(close(a, b) for a, b in zip(got["losses"], losses, strict=True)) <= 1e-5, name
        assert max(close(a, b) for a, b in zip(got["norms"], norms, strict=True)) <= 1e-5, name
        for unit, w in weights.items():
            for n, t in w.items():
                assert rel(got["weights"][unit][n], t) <= 1e-5, (name, unit, n)
        for rank in range(2):
            mine = torch.load(tmp_path / f"{name}.rank{rank}.pt")
            assert mine["traffic"] == mine["planned"], (name, rank)


def test_gemma3_12b_plans_within_4_gib_with_its_slices(capsys):
    """Gemma 3 12B's preset cuts its tied 262208 × 3840 head into 8 vocabulary slices: the head phase holds its
    bfloat16 table (1.88 GiB), one slice's float32 gradient and a chunk's logits, the embeddings' phase the
    table and streamed pieces, its float32 gradient in host memory; 13.13 GiB without the slices."""
    from cli_helpers import run_cli

    def plan(*overrides):
        code, out, err = run_cli(capsys, "plan", "--config", "gemma3-12b", *overrides, "--json")
        assert code == 0, err
        return json.loads(out)

    planned, whole = plan(), plan("execution.head_vocab_slices=0")
    assert planned["device_peak_bytes"] <= 4 * GIB < 13 * GIB < whole["device_peak_bytes"]
    held = {p["phase"]: p["device"] for p in planned["program"]}
    table = 262208 * 3840 * 2
    assert held["embeddings:backward+global_norm+optimizer_step"]["loaded"] == table  # no float32 gradient
    assert held["head:loss_backward"]["loaded"] == table + 3840 * 2  # and its final norm
    assert held["head:loss_backward"]["compute"] < 1.2 * GIB
