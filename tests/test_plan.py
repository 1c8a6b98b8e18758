"""``ipuft plan``: GPT-J-6B plans from its real shapes without being allocated."""

import json

from cli_helpers import run_cli

GPTJ_6B_PARAMETERS = 6_050_882_784


def plan(capsys, *args):
    code, out, err = run_cli(capsys, "plan", *args)
    assert code == 0, err
    return out


def test_gptj_6b_plans_without_allocating(capsys):
    result = json.loads(plan(capsys, "--config", "gptj-6b", "--json"))
    assert result["parameters"] == GPTJ_6B_PARAMETERS
    layer = 4096 * 4096 * 4 + 4096 * 16384 * 2 + 16384 + 4096 + 2 * 4096  # q,k,v,out; fc_in, fc_out; biases; norm
    emb, head = 50400 * 4096, 2 * 4096 + 50400 * 4096 + 50400
    assert layer * 28 + emb + head == GPTJ_6B_PARAMETERS
    f32 = 4
    # weights, Adam's m and v, and the stored gradients of the decoder layers and the head.
    assert result["host_bytes"] == f32 * (4 * GPTJ_6B_PARAMETERS - emb)
    # per step: each layer's weights cross 3 times, the embeddings' and head's twice; state and grads once.
    assert result["traffic"]["h2d"]["fwd"] == f32 * (3 * 28 * layer + 2 * emb + 2 * head)
    assert result["traffic"]["h2d"]["optim"] == f32 * 2 * GPTJ_6B_PARAMETERS
    assert result["traffic"]["d2h"]["grad"] == f32 * (28 * layer + head)
    assert [p["phase"] for p in result["program"]][:2] == ["embeddings:forward", "decoder.0:forward"]
    assert len(result["program"]) == 3 * 28 + 4


def test_plan_text_lists_phases_and_totals(capsys):
    out = plan(capsys, "--config", "tiny")
    assert "decoder.1:backward" in out and "load: fwd 0.189 MiB" in out
    assert "host->device / step:" in out and "device peak (est.):" in out


def test_activation_offload_moves_the_buffers_to_the_host(capsys):
    on = json.loads(plan(capsys, "--config", "tiny", "execution.activation_offload=true", "--json"))
    off = json.loads(plan(capsys, "--config", "tiny", "--json"))
    act = 1 * 8 * 64 * 4  # one micro-batch's layer-boundary activation
    # x: written for rows 0..L, read by the forward, the head and the backward; dx: L+1 writes and reads.
    assert on["traffic"]["d2h"]["activation"] == 16 * act * (3 + 3)
    assert on["traffic"]["h2d"]["activation"] == 16 * act * ((2 + 1 + 2) + 3)
    assert "activation" not in off["traffic"]["h2d"]
    assert on["host_bytes"] - off["host_bytes"] == 2 * 3 * 16 * act  # x and dx, L+1 rows of GA each
    assert on["device_peak_bytes"] <= off["device_peak_bytes"]


def test_rts_divides_per_rank_host_bytes_by_about_dp(capsys):
    plans = {dp: json.loads(plan(capsys, "--config", "gptj-6b", f"execution.data_parallel={dp}",
                                 "training.global_batch_size=128", "--json")) for dp in (1, 4)}
    assert plans[4]["rts"] is True and plans[1]["rts"] is False
    assert 0.2499 <= plans[4]["host_bytes"] / plans[1]["host_bytes"] <= 0.2501
    assert 0.2499 <= plans[4]["traffic"]["h2d"]["fwd"] / plans[1]["traffic"]["h2d"]["fwd"] <= 0.2501
    no_rts = json.loads(plan(capsys, "--config", "gptj-6b", "execution.data_parallel=4", "execution.rts=false",
                             "--json"))
    assert no_rts["host_bytes"] == plans[1]["host_bytes"]
    tp = json.loads(plan(capsys, "--config", "gptj-6b", "execution.tensor_parallel=16", "--json"))
    assert 1 / 16 < tp["host_bytes"] / plans[1]["host_bytes"] < 1.1 / 16  # layer norms are replicated
