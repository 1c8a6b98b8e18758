"""``ipuft plan``: GPT-J-6B plans from its real shapes without being allocated."""

import json

from cli_helpers import run_cli

GPTJ_6B_PARAMETERS = 6_050_882_784


def plan(capsys, *args):
    code, out, err = run_cli(capsys, "plan", *args)
    assert code == 0, err
    return out


LAYER = 4096 * 4096 * 4 + 4096 * 16384 * 2 + 16384 + 4096 + 2 * 4096  # q,k,v,out; fc_in, fc_out; biases; norm
EMB, HEAD = 50400 * 4096, 2 * 4096 + 50400 * 4096 + 50400
GIB = 2**30


def test_gptj_6b_plans_without_allocating(capsys):
    """The preset's recipe: float16 weights and activations, float32 Adam state, stochastic rounding."""
    result = json.loads(plan(capsys, "--config", "gptj-6b", "--json"))
    assert result["parameters"] == GPTJ_6B_PARAMETERS
    assert LAYER * 28 + EMB + HEAD == GPTJ_6B_PARAMETERS
    assert (result["precision"], result["update"], result["activation_offload"]) == ("float16", "stochastic", True)
    f16, f32 = 2, 4
    # 16-bit weights, Adam's float32 m and v, and the 16-bit stored gradients of the decoder layers and the head.
    assert result["variable_bytes"] == f16 * GPTJ_6B_PARAMETERS + 2 * f32 * GPTJ_6B_PARAMETERS + f16 * (
        GPTJ_6B_PARAMETERS - EMB)
    # x[L+1][GA] at the end of the forward, one micro-batch of 1024 tokens × 4096 in float16 each.
    assert result["activation_bytes"] == 29 * 128 * 1024 * 4096 * f16
    assert result["host_bytes"] == result["variable_bytes"] + result["activation_bytes"]
    # per step: each layer's weights cross 3 times, the embeddings' and head's twice; state and grads once.
    assert result["traffic"]["h2d"]["fwd"] == f16 * (3 * 28 * LAYER + 2 * EMB + 2 * HEAD)
    assert result["traffic"]["h2d"]["optim"] == f32 * 2 * GPTJ_6B_PARAMETERS
    assert result["traffic"]["d2h"]["grad"] == f16 * (28 * LAYER + HEAD)
    assert [p["phase"] for p in result["program"]][:2] == ["embeddings:forward", "decoder.0:forward"]
    assert len(result["program"]) == 3 * 28 + 4


def test_gptj_6b_fits_one_small_gpu_and_a_large_host(capsys):
    one = json.loads(plan(capsys, "--config", "gptj-6b", "--json"))
    assert one["device_peak_bytes"] <= 4 * GIB
    assert one["host_bytes"] <= 100 * GIB
    eight = json.loads(plan(capsys, "--config", "gptj-6b", "execution.data_parallel=8", "--json"))
    assert eight["rts"] is True
    assert eight["host_bytes"] <= 14 * GIB
    float32 = json.loads(plan(capsys, "--config", "gptj-6b", "model.precision=float32",
                              "training.stochastic_rounding=false", "--json"))
    assert float32["host_bytes"] > 140 * GIB  # what 16-bit saves


def test_plan_says_whether_the_run_fits_and_what_would_make_it(hooks, make_config):
    from ipuft.engine.model import build_model
    from ipuft.plan.estimate import estimate
    from ipuft.plan.fit import fit, format_fit

    cfg = make_config("model.layers=4", "model.hidden_size=256", "execution.activation_offload=true")
    result = estimate(cfg, build_model(cfg, hooks), hooks)
    # On the CPU the device is host memory too: the process, the store and what the phases add to it (a load
    # lends the stored variables, so the device peak's loads are not more memory), with the heap glibc keeps.
    process = 300 * 2**20
    needed = process + result["host_bytes"] + result["cpu_working_bytes"]
    roomy = fit(cfg, hooks, result, {"host_available_bytes": needed, "device_free_bytes": None,
                                     "process_bytes": process})
    assert roomy["fits"] and roomy["host_needed_bytes"] == needed
    assert format_fit(cfg, roomy).startswith("fits this machine: host")
    tight = fit(cfg, hooks, result, {"host_available_bytes": needed - 1, "device_free_bytes": None,
                                     "process_bytes": process})
    assert not tight["fits"]
    assert tight["would_fit_with"] == ["model.precision=bfloat16 training.stochastic_rounding=true "
                                       "training.master_weights=false"]
    assert "does NOT fit this machine" in format_fit(cfg, tight) and "model.precision=bfloat16" in format_fit(cfg, tight)
    cfg = make_config("model.layers=2", "model.sequence_length=128")  # the activations dominate the device
    result = estimate(cfg, build_model(cfg, hooks), hooks)
    gpu = fit(cfg, hooks, result, {"host_available_bytes": 10**12, "device_free_bytes": result["device_peak_bytes"] - 1})
    assert not gpu["fits"] and gpu["device_needed_bytes"] == result["device_peak_bytes"]
    assert "execution.activation_offload=true" in gpu["would_fit_with"]


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
    # x[L+1][GA] at the end of the forward; dx never holds more than the x entries already consumed.
    assert on["host_bytes"] - off["host_bytes"] == 3 * 16 * act == on["activation_bytes"]
    assert on["device_peak_bytes"] <= off["device_peak_bytes"]


def test_rts_divides_per_rank_host_bytes_by_about_dp(capsys):
    plans = {dp: json.loads(plan(capsys, "--config", "gptj-6b", f"execution.data_parallel={dp}",
                                 "training.global_batch_size=128", "--json")) for dp in (1, 4)}
    assert plans[4]["rts"] is True and plans[1]["rts"] is False
    assert 0.2499 <= plans[4]["host_bytes"] / plans[1]["host_bytes"] <= 0.2501  # GA, and the activations, too
    assert 0.2499 <= plans[4]["traffic"]["h2d"]["fwd"] / plans[1]["traffic"]["h2d"]["fwd"] <= 0.2501
    no_rts = json.loads(plan(capsys, "--config", "gptj-6b", "execution.data_parallel=4", "execution.rts=false",
                             "--json"))
    assert no_rts["variable_bytes"] == plans[1]["variable_bytes"]
    tp = json.loads(plan(capsys, "--config", "gptj-6b", "execution.tensor_parallel=16", "--json"))
    # layer norms are replicated
    assert 1 / 16 < tp["variable_bytes"] / plans[1]["variable_bytes"] < 1.1 / 16


def test_gptj_6b_with_the_optimizer_on_the_host(capsys):
    """execution.optimizer_placement=host: Adam's state never crosses, each gradient crosses device→host once
    and the weights only come for the forward and the backward; the update phases load nothing (the device
    placement's bring only their streamed pieces); the embeddings' gradient is stored (in float16) for its host
    update."""
    device = json.loads(plan(capsys, "--config", "gptj-6b", "--json"))
    host = json.loads(plan(capsys, "--config", "gptj-6b", "execution.optimizer_placement=host", "--json"))
    f16 = 2
    assert host["optimizer_placement"] == "host"
    assert host["traffic"]["h2d"] == {"data": device["traffic"]["h2d"]["data"], "fwd": f16 * (2 * 28 * LAYER + 2 * EMB + HEAD),
                                      "activation": device["traffic"]["h2d"]["activation"]}
    assert host["traffic"]["d2h"] == {"grad": f16 * GPTJ_6B_PARAMETERS, "activation": device["traffic"]["d2h"]["activation"]}
    weights = {d: sum(n for k, n in device["traffic"][d].items() if k in ("fwd", "optim", "grad")) for d in ("h2d", "d2h")}
    assert device["h2d_bytes_per_step"] - host["h2d_bytes_per_step"] == weights["h2d"] - host["traffic"]["h2d"]["fwd"]
    assert host["host_bytes"] - device["host_bytes"] == f16 * EMB
    # The device placement streams its updates piece by piece (ipuft.engine.streaming): neither peak is an update.
    assert host["device_peak_bytes"] <= device["device_peak_bytes"]
    # Phase by phase: an update-only phase in host memory holds nothing on the device and loads nothing for it;
    # the embeddings' backward-and-update phase loads only their weights.
    updates = [(h, d) for h, d in zip(host["program"], device["program"]) if h["host_update"]]
    assert len(updates) == 28 + 2
    for on_host, on_device in updates:
        if on_device["device"]["compute"] == 0:
            assert on_host["device"] == {"loaded": 0, "compute": 0, "update": 0} != on_device["device"]
        else:
            # their weights only; the device placement streams the optimizer state
            assert on_host["device"]["loaded"] == f16 * EMB == on_device["device"]["loaded"]
            assert on_host["device"]["update"] == 0 < on_device["device"]["update"]
