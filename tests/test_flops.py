"""Model FLOPs: each unit's forward, backward and recompute counted from the real shapes (fake tensors), by the
step program; against GPT-J's matmuls written out, at TP=1 and on a rank of TP=2; and what bench and the
metrics report from them."""

import json

import pytest
from cli_helpers import run_cli

from ipuft.engine.model import build_model
from ipuft.plan.flops import _repeated, step_flops, utilisation
from ipuft.plan.measure import unit_cost


def gptj(cfg):
    """One micro-batch's matmul FLOPs of each GPT-J unit on one rank, written out: ``{role: (forward,
    backward, recompute)}``. Every linear's backward is two matmuls of its forward's size (input and weight
    gradients); attention's forward is two ``T × T`` matmuls per head and its backward five (a flash kernel
    recomputes the scores: FlopCounterMode's count, which ipuft's CPU formula shares). The recompute skips the
    output projections (out_proj, fc_out), whose forward value is not used."""
    m, tp = cfg.model, cfg.execution.tensor_parallel
    tokens, h, i = cfg.execution.micro_batch_size * m.sequence_length, m.hidden_size, m.intermediate_size
    heads, d = m.attention.heads // tp, m.hidden_size // m.attention.heads
    vocab = -(-m.embedding.vocab_size // (16 * tp)) * 16 if tp > 1 else m.embedding.vocab_size  # padded, per rank
    attention = 4 * cfg.execution.micro_batch_size * heads * m.sequence_length**2 * d
    linears = 2 * tokens * (4 * h * h + 2 * h * i) // tp
    skipped = 2 * tokens * (h * h + h * i) // tp
    head = 2 * tokens * h * vocab
    return {"embeddings": (0, 0, 0), "decoder": (linears + attention, 2 * linears + 5 * attention // 2,
                                                 linears - skipped + attention), "head": (head, 2 * head, head)}


@pytest.mark.parametrize("tp", [1, 2])
def test_unit_flops_are_gptjs_matmuls(hooks, make_config, tp):
    cfg = make_config("model.hidden_size=128", "model.sequence_length=16", f"execution.tensor_parallel={tp}")
    parts = build_model(cfg, hooks)
    for role, (forward, backward, again) in gptj(cfg).items():
        cost = unit_cost(parts, role, cfg)
        assert (cost.forward, cost.backward, cost.recompute) == (forward, backward, again), role


def test_a_step_counts_every_micro_batch_and_the_recompute_apart(hooks, make_config):
    cfg = make_config("training.global_batch_size=8", "execution.micro_batch_size=2")
    assert cfg.gradient_accumulation == 4
    (_, _, _), (df, db, dr), (hf, hb, _) = gptj(cfg).values()
    flops = step_flops(cfg, build_model(cfg, hooks))
    layers = cfg.model.layers
    assert flops.model == 4 * (layers * (df + db) + hf + hb)
    assert flops.recompute == 4 * layers * dr
    assert flops.by_phase["decoder"] == {"forward": (4 * layers * df, 0), "backward": (4 * layers * db, 4 * layers * dr)}
    assert flops.by_phase["head"] == {"loss_backward": (4 * (hf + hb), 0)}
    kept = step_flops(make_config("training.global_batch_size=8", "execution.micro_batch_size=2",
                                  "execution.offload=false", "execution.recompute=false"), build_model(cfg, hooks))
    assert (kept.model, kept.recompute) == (flops.model, 0)  # nothing recomputed, the same model FLOPs
    assert utilisation(flops, 2.0, peak=flops.model) == {"model_flops_per_s": flops.model / 2,
                                                         "recompute_flops_per_s": flops.recompute / 2,
                                                         "mfu": 0.5, "hfu": 0.5 * (flops.model + flops.recompute)
                                                         / flops.model}


def test_plan_bench_and_metrics_report_them(capsys, hooks, make_config, tmp_path):
    cfg = make_config()
    expected = step_flops(cfg, build_model(cfg, hooks))
    code, out, err = run_cli(capsys, "plan", "--config", "tiny", "--json")
    assert code == 0, err
    assert json.loads(out)["flops_per_step"]["model"] == expected.model
    code, out, err = run_cli(capsys, "bench", "--config", "tiny", "--steps", "2", "--json")
    assert code == 0, err
    bench = json.loads(out)
    assert (bench["model_flops_per_step"], bench["recompute_flops_per_step"]) == (expected.model, expected.recompute)
    assert bench["model_flops_per_s"] == pytest.approx(expected.model / bench["duration_s"])
    peak = bench["matmul_peak"]
    assert peak["shape"] == [8, 64, 256] and peak["dtype"] == "float32" and peak["flops_per_s"] > 0
    assert bench["mfu"] == pytest.approx(bench["model_flops_per_s"] / peak["flops_per_s"])
    assert bench["hfu"] == pytest.approx((expected.model + expected.recompute) / bench["duration_s"] / peak["flops_per_s"])
    code, _, err = run_cli(capsys, "train", "--config", "tiny", "training.steps=2", f"output_dir={tmp_path}/run")
    assert code == 0, err
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert record["model_flops_per_s"] == pytest.approx(expected.model / record["step_time_s"])
        assert record["recompute_flops_per_s"] == pytest.approx(expected.recompute / record["step_time_s"])


def test_a_matmul_is_repeated_at_least_three_times_and_for_the_seconds_asked():
    """Runs until their seconds reach the time asked, and never fewer than three (a run's seconds are exact
    binary fractions here, so that the total is exact)."""
    assert _repeated(lambda: 0.25, 1.0) == [0.25] * 4
    assert _repeated(lambda: 0.125, 1.0 - 2**-10) == [0.125] * 8
    assert _repeated(lambda: 2.0, 1.0) == [2.0] * 3
