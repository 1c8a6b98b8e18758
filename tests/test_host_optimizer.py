"""execution.optimizer_placement=host: updates run in host memory, where the variables live. They give the
device placement's results bit for bit, move no optimizer state, and move each gradient device→host once."""

import math

import dist_workers
import pytest
import torch
from distributed import spawn
from test_engine import EQUIVALENCE, batches, make_engine, run_engine
from test_precision import BF16_MASTER, BF16_NEAREST, BF16_SR, FP16_SR

from ipuft.engine.model import build_model
from ipuft.plan.estimate import estimate

# float16 from a loss scale of 2^20: the first three steps overflow and are skipped, the last two update.
RECIPES = {"float32": (), "bf16-sr": BF16_SR, "bf16-master": BF16_MASTER, "bf16-nearest": BF16_NEAREST,
           "fp16-sr-dynamic": (*FP16_SR, "execution.loss_scaling_initial=1048576"),
           "frozen-embeddings-and-head": ("model.freeze=[embeddings,head]",)}


def both_placements(make_config, hooks, *overrides):
    """Five steps of the engine-equivalence config with the optimizer on the device and on the host."""
    runs = {}
    for placement in ("device", "host"):
        cfg = make_config(*EQUIVALENCE, *overrides, f"execution.optimizer_placement={placement}")
        engine = make_engine(cfg, hooks)
        initial = {u: {n: t.clone() for n, t in w.items()} for u, w in engine.model.weights().items()}
        results = run_engine(engine, cfg)
        planned = estimate(cfg, engine.parts, hooks)
        for r in results:
            assert r.device_peak_bytes <= planned["device_peak_bytes"]
            assert r.traffic == planned["traffic"] or r.skipped  # a skipped step stores no update back
        runs[placement] = (engine, results, initial)
    return runs


@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
def test_host_updates_equal_device_updates_bit_for_bit(hooks, make_config, recipe):
    runs = both_placements(make_config, hooks, *recipe, "execution.activation_offload=true")
    (device, on_device, initial), (host, on_host, _) = runs["device"], runs["host"]
    assert host.host_update and not device.host_update
    for a, b in zip(on_device, on_host, strict=True):
        assert (a.loss, a.skipped, a.loss_scale) == (b.loss, b.skipped, b.loss_scale)
        assert a.grad_norm == b.grad_norm or (math.isnan(a.grad_norm) and math.isnan(b.grad_norm))  # a skip's
    if "execution.loss_scaling=dynamic" in recipe:
        assert [r.skipped for r in on_host] == [True, True, True, False, False]
    changed = trainable = 0
    for unit, groups in device.store.entries.items():
        for group in ("fwd", "optim"):
            assert groups[group].keys() == host.store.entries[unit][group].keys()
            for name, t in groups[group].items():
                assert torch.equal(t, host.store.entries[unit][group][name]), f"{unit} {group} {name}"
        for name, t in groups["fwd"].items():
            if name in device.trainable[unit.role]:
                trainable += 1
                changed += not torch.equal(t, initial[unit][name])
            else:
                assert torch.equal(t, initial[unit][name])
    assert trainable and changed >= 0.9 * trainable  # the runs really trained


def test_host_updates_move_no_optimizer_state_and_each_gradient_once(hooks, make_config):
    """Per step, with the optimizer on the host: m and v never cross; every gradient crosses device→host once
    (the embeddings' too, into a stored gradient it has only with this placement) and never comes back; the
    weights come to the device only for the forward and the backward and never go back. The counters equal
    the plan, and the plan's device peak drops the update phases' loads."""
    traffic, planned, engines = {}, {}, {}
    for placement in ("device", "host"):
        cfg = make_config("training.global_batch_size=4", f"execution.optimizer_placement={placement}")
        engine = engines[placement] = make_engine(cfg, hooks)
        planned[placement] = estimate(cfg, engine.parts, hooks)
        for batch in batches(cfg)[:2]:
            result = engine.step(batch, 1e-3)
            assert result.traffic == planned[placement]["traffic"]
            assert result.device_peak_bytes <= planned[placement]["device_peak_bytes"]
        traffic[placement] = result.traffic
        assert engine.store.host_bytes() == planned[placement]["host_bytes"]
    parts = engines["host"].parts
    size = {role: sum(v.nbytes for v in parts.variables[role]) for role in parts.variables}
    layers = cfg.model.layers
    weights = size["embeddings"] + layers * size["decoder"] + size["head"]
    host, device = traffic["host"], traffic["device"]
    assert set(host["h2d"]) == {"data", "fwd"} and set(host["d2h"]) == {"grad"}
    assert host["d2h"]["grad"] == weights
    # embeddings: forward and backward; decoder layers: forward and backward-with-recompute; head: loss_backward
    assert host["h2d"]["fwd"] == 2 * size["embeddings"] + 2 * layers * size["decoder"] + size["head"]
    # with the optimizer on the device, the update phases brought weights, m, v and gradients back and forth
    assert device["h2d"]["fwd"] - host["h2d"]["fwd"] == layers * size["decoder"] + size["head"]
    assert device["h2d"]["optim"] == device["d2h"]["optim"] == 2 * weights
    assert device["h2d"]["grad"] == weights - size["embeddings"] == device["d2h"]["grad"]
    assert device["d2h"]["fwd"] == weights
    assert planned["host"]["variable_bytes"] - planned["device"]["variable_bytes"] == size["embeddings"]
    assert engines["host"].store.entries["embeddings"]["grad"].keys() == {v.name for v in parts.variables["embeddings"]}
    assert "grad" not in engines["device"].store.entries["embeddings"]
    assert planned["host"]["device_peak_bytes"] <= planned["device"]["device_peak_bytes"]
    # Here the backward, holding GA micro-batches' projection inputs for its weight gradients, is the busiest
    # phase; with two micro-batches the update is, and updating on the host lowers the peak.
    fewer = {p: make_config("training.global_batch_size=2", f"execution.optimizer_placement={p}") for p in planned}
    peaks = {p: estimate(c, build_model(c, hooks), hooks)["device_peak_bytes"] for p, c in fewer.items()}
    assert peaks["host"] < peaks["device"]
    updates = [p for p in planned["host"]["program"] if p["host_update"]]
    assert [p["phase"] for p in updates] == ["embeddings:backward+global_norm+optimizer_step",
                                             *(f"decoder.{n}:optimizer_step" for n in range(layers)), "head:optimizer_step"]
    assert all(p["loads"] == p["stores"] == {} for p in updates[1:])
    assert updates[0]["loads"] == {"fwd": size["embeddings"]} and updates[0]["stores"] == {"grad": size["embeddings"]}


BASE = ["model.embedding.vocab_size=100", "execution.micro_batch_size=1", "training.global_batch_size=4",
        "execution.data_parallel=2", "execution.tensor_parallel=2", "execution.rts=true",
        "execution.activation_offload=true", "training.optimizer.learning_rate.maximum=2e-3",
        "training.optimizer.gradient_clipping=0.5", "execution.loss_scaling=16", "plugins.adamw.weight_decay=0.1"]


def test_host_updates_equal_device_updates_under_dp2_tp2_rts(tmp_path):
    """Four Gloo ranks (DP2 × TP2, RTS): each rank updates its stored shards in host memory, in float32 and in
    bfloat16 with stochastic rounding (whose bits follow each element's index in the full variable), with
    the same gathered weights and optimizer state as device updates, bit for bit; every rank's counters equal
    its plan."""
    steps = 3
    configs = {f"{recipe}_{placement}": [*BASE, *extra, f"training.steps={steps}",
                                         f"execution.optimizer_placement={placement}"]
               for recipe, extra in (("f32", []), ("bf16sr", BF16_SR)) for placement in ("device", "host")}
    spawn(4, dist_workers.train_configs, configs, steps, str(tmp_path), tmp=tmp_path)
    for recipe in ("f32", "bf16sr"):
        device, host = (torch.load(tmp_path / f"{recipe}_{p}.rank0.pt") for p in ("device", "host"))
        assert (device["losses"], device["norms"]) == (host["losses"], host["norms"])
        for group in ("weights", "optim"):
            assert device[group].keys() == host[group].keys()
            for unit, tensors in device[group].items():
                for name, t in tensors.items():
                    assert torch.equal(t, host[group][unit][name]), f"{recipe} {group} {unit}.{name}"
        for rank in range(4):
            mine = torch.load(tmp_path / f"{recipe}_host.rank{rank}.pt")
            assert mine["traffic"] == mine["planned"], (recipe, rank)
            assert "optim" not in mine["traffic"]["h2d"] and "optim" not in mine["traffic"]["d2h"]
