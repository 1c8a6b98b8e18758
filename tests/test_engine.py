"""The phased engine equals a plain single-module autograd reference, and moves exactly what the plan says."""

import math

import pytest
import torch
import torch.nn.functional as F
from hf_reference import hf_gptj, hf_state

from ipuft.data.synthetic import SampleData
from ipuft.engine.model import build_model
from ipuft.engine.phased import PhasedEngine
from ipuft.errors import ConfigError
from ipuft.plan.estimate import estimate
from ipuft.plan.measure import unit_cost
from ipuft.run.schedule import learning_rate

STEPS = 5
# GA=4, clipping active (the gradient norm is well above 0.05), weight decay on, a loss scale to remove.
EQUIVALENCE = ("training.global_batch_size=8", "execution.micro_batch_size=2",
               "training.optimizer.gradient_clipping=0.05", "plugins.adamw.weight_decay=0.1",
               "training.optimizer.learning_rate.maximum=3e-3", "training.optimizer.learning_rate.warmup_proportion=0.4",
               "execution.loss_scaling=64", f"training.steps={STEPS}", "model.layers=3")


def make_engine(cfg, hooks):
    parts = build_model(cfg, hooks)
    optimizer = hooks.registrations.build_optimizer(cfg)
    return PhasedEngine(cfg, parts, optimizer, torch.device("cpu"))


def batches(cfg):
    data = SampleData(cfg.model.embedding.vocab_size, cfg.model.sequence_length, cfg.data.seed)
    return [data.batch(s, cfg.training.global_batch_size, cfg.execution.micro_batch_size) for s in range(STEPS)]


def adam_update(cfg):
    """The update of point 5, written out plainly over Hugging Face parameter names."""
    o = cfg.plugins.adamw
    m, v = {}, {}

    def update(name, p, g, lr, t):
        m[name] = o.beta1 * m.get(name, 0) + (1 - o.beta1) * g
        v[name] = o.beta2 * v.get(name, 0) + (1 - o.beta2) * g * g
        u = (m[name] / (1 - o.beta1**t)) / ((v[name] / (1 - o.beta2**t)).sqrt() + o.eps)
        if not (name.endswith("bias") or ".ln_" in name):
            u = u + o.weight_decay * p
        p -= lr * u

    return update


def reference_training(cfg, initial_hf_state, update=None, frozen=()):
    """The whole model as one module (transformers' GPT-J), torch autograd, and a plain update loop.

    ``update(name, param, clipped_unscaled_grad, lr, t)`` applies the optimizer (Adam by default). Parameters
    whose name starts with one of ``frozen`` get no gradient, no update and no part in the norm.
    """
    model = hf_gptj(cfg)
    model.load_state_dict(initial_hf_state)
    model.train()
    o, S = cfg.training.optimizer, cfg.execution.loss_scaling
    update = update or adam_update(cfg)
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith(tuple(frozen)))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    losses, norms = [], []
    for step, batch in enumerate(batches(cfg)):
        model.zero_grad()
        ga = batch.micro_batches
        step_loss = 0.0
        for mb in range(ga):
            logits = model(batch.input_ids[mb]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), batch.labels[mb].flatten())
            (loss * S / ga).backward()
            step_loss += loss.item() / ga
        norm = math.sqrt(sum(float((p.grad / S).double().pow(2).sum()) for p in params.values()))
        lr = learning_rate(step, STEPS, o.learning_rate)
        scale = (1 / S) * o.gradient_clipping / max(norm, o.gradient_clipping)
        with torch.no_grad():
            for n, p in params.items():
                update(n, p, p.grad * scale, lr, step + 1)
        losses.append(step_loss)
        norms.append(norm)
    return losses, norms, {n: p.detach() for n, p in params.items()}


def initial_weights(engine, cfg):
    return hf_state(engine.modules, cfg.model.layers,
                 {u: {n: t.clone() for n, t in w.items()} for u, w in engine.model.weights().items()})


def run_engine(engine, cfg):
    return [engine.step(b, learning_rate(s, STEPS, cfg.training.optimizer.learning_rate))
            for s, b in enumerate(batches(cfg))]


def assert_matches(cfg, engine, results, reference, initial, frozen=()):
    ref_losses, ref_norms, ref_weights = reference
    for r, loss, norm in zip(results, ref_losses, ref_norms, strict=True):
        assert abs(r.loss - loss) / abs(loss) <= 1e-5
        assert abs(r.grad_norm - norm) / norm <= 1e-5
    weights = hf_state(engine.modules, cfg.model.layers, engine.model.weights())
    assert set(weights) == set(ref_weights) | set(frozen)
    for name, w in weights.items():
        if name in frozen:
            assert torch.equal(w, initial[name]), f"frozen {name} changed"
            continue
        assert max_rel(w, ref_weights[name]) <= 1e-5, name
        assert not torch.equal(w, initial[name]), f"{name} never changed"


def max_rel(a, b):
    """max |a - b| / max |b|, over a tensor."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module")
def reference(request):
    from ipuft.config import load_config
    from ipuft.plugins import create_plugin_manager

    hooks = create_plugin_manager()
    cfg = load_config("tiny", list(EQUIVALENCE), hooks.registrations.config_sections)
    initial = initial_weights(make_engine(cfg, hooks), cfg)
    return reference_training(cfg, initial), initial


@pytest.mark.parametrize(("offload", "activation_offload", "recompute"),
                         [(True, True, True), (True, False, True), (False, True, True), (False, False, True),
                          (False, False, False)])
def test_five_steps_equal_the_plain_reference(hooks, make_config, reference, offload, activation_offload, recompute):
    cfg = make_config(*EQUIVALENCE, f"execution.offload={offload}", f"execution.activation_offload={activation_offload}",
                      f"execution.recompute={recompute}")
    assert cfg.gradient_accumulation == 4
    engine = make_engine(cfg, hooks)
    (ref_losses, ref_norms, ref_weights), initial = reference
    assert min(ref_norms) > 4 * cfg.training.optimizer.gradient_clipping  # clipping is active on every step
    assert_matches(cfg, engine, run_engine(engine, cfg), (ref_losses, ref_norms, ref_weights), initial)
    assert len(engine.buffers) == 0  # every activation was consumed
    assert engine.compute.graph_bytes == 0 and not engine.compute.graphs  # and every kept graph


@pytest.mark.parametrize("every", [1, 3])
def test_weight_gradients_taken_a_few_micro_batches_at_a_time(hooks, make_config, reference, monkeypatch, every):
    """Takes of fewer micro-batches than GA (a long sequence's, see ipuft.ops): ``every`` micro-batches at a time,
    the last take the rest; the steps still equal the plain reference, and the plan bounds what the ledger
    counts (the pieces the takes hold included)."""
    from ipuft.engine import cuts

    cfg = make_config(*EQUIVALENCE)
    tokens = cfg.execution.micro_batch_size * cfg.model.sequence_length
    monkeypatch.setattr(cuts, "TAKE_TOKENS", every * tokens)
    assert cuts.take_every(cfg.gradient_accumulation, tokens) == every
    engine = make_engine(cfg, hooks)
    (ref_losses, ref_norms, ref_weights), initial = reference
    results = run_engine(engine, cfg)
    assert_matches(cfg, engine, results, (ref_losses, ref_norms, ref_weights), initial)
    planned = estimate(cfg, engine.parts, hooks)
    assert max(r.device_peak_bytes for r in results) <= planned["device_peak_bytes"]


def test_a_whole_take_reuses_the_stored_gradients_memory(hooks, make_config):
    """On a CPU device a gradient taken over every micro-batch at once is written into the gradient its unit
    stored the step before (consumed by that step's update) instead of a fresh tensor; the steps are those
    of an engine whose takes are fresh."""
    cfg = make_config(*EQUIVALENCE, "model.precision=bfloat16", "training.stochastic_rounding=true")
    engine, fresh = make_engine(cfg, hooks), make_engine(cfg, hooks)
    fresh._gradient_homes = lambda phase: {}
    unit = "decoder.1"
    for step, batch in enumerate(batches(cfg)[:3]):
        before = {n: t.data_ptr() for n, t in engine.store.entries[unit]["grad"].items()}
        a, b = engine.step(batch, 1e-3), fresh.step(batch, 1e-3)
        assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm)
        after = {n: t.data_ptr() for n, t in engine.store.entries[unit]["grad"].items()}
        taken = {n for n in after if n.endswith("proj.weight") or n.startswith("mlp.fc_in.")}
        assert taken and all(after[n] == before[n] for n in taken), step
    for unit, weights in engine.model.weights().items():
        for name, t in weights.items():
            assert torch.equal(t, fresh.model.weights()[unit][name]), (unit, name)


@pytest.mark.parametrize("recompute", [True, False])
def test_the_embeddings_gradient_is_taken_once_over_the_micro_batches(hooks, make_config, monkeypatch, recompute):
    """The embedding table's gradient is one take over all four micro-batches (ipuft.ops.embedding), not four
    dense tables from autograd, with or without the recompute; the steps are still the reference's
    (test_five_steps_equal_the_plain_reference)."""
    import ipuft.ops

    made, rows_gradient = [], ipuft.ops._rows_gradient
    monkeypatch.setattr(ipuft.ops, "_rows_gradient", lambda *args: made.append(args[1].numel()) or rows_gradient(*args))
    cfg = make_config(*EQUIVALENCE, *([] if recompute else ["execution.recompute=false", "execution.offload=false"]))
    engine = make_engine(cfg, hooks)
    for batch in batches(cfg)[:2]:
        engine.step(batch, 1e-3)
    assert made == [4 * cfg.execution.micro_batch_size * cfg.model.sequence_length] * 2  # every token, each step


def test_swapped_optimizer_through_config_alone(fake_dist):
    """The test plugin's SGD with momentum, installed through an entry point and chosen by one key."""
    from ipuft.config import load_config
    from ipuft.plugins import create_plugin_manager

    fake_dist("ipuft-test-sgd", {"sgd": "ipuft_test_sgd"})
    hooks = create_plugin_manager()
    overrides = [*(o for o in EQUIVALENCE if not o.startswith("plugins.adamw.")), "training.optimizer.name=sgd",
                 "plugins.sgd.momentum=0.8"]
    cfg = load_config("tiny", overrides, hooks.registrations.config_sections)
    engine = make_engine(cfg, hooks)
    assert type(engine.optimizer).__name__ == "SGD"
    assert engine.store.entries["decoder.0"]["optim"].keys() == {
        f"{v.name}.momentum" for v in engine.parts.variables["decoder"]}
    buf = {}

    def sgd(name, p, g, lr, t):
        buf[name] = 0.8 * buf.get(name, 0) + g
        p -= lr * buf[name]

    initial = initial_weights(engine, cfg)
    reference = reference_training(cfg, initial, sgd)
    assert_matches(cfg, engine, run_engine(engine, cfg), reference, initial)


@pytest.mark.parametrize("activation_offload", [True, False])
@pytest.mark.parametrize(("offload", "placement"), [(True, "device"), (False, "device"), (True, "host")])
def test_counters_equal_the_plan(hooks, make_config, offload, placement, activation_offload):
    cfg = make_config("training.global_batch_size=4", f"execution.offload={offload}",
                      f"execution.activation_offload={activation_offload}", f"execution.optimizer_placement={placement}")
    engine = make_engine(cfg, hooks)
    planned = estimate(cfg, engine.parts, hooks)
    for batch in batches(cfg)[:2]:
        result = engine.step(batch, 1e-3)
        assert result.traffic == planned["traffic"]
        assert (result.h2d_bytes, result.d2h_bytes) == (planned["h2d_bytes_per_step"], planned["d2h_bytes_per_step"])
        assert result.device_peak_bytes <= planned["device_peak_bytes"]
        # x[L+1][GA] at the end of the forward, wherever the buffers are; dx holds only rows in flight.
        assert result.activation_bytes == planned["activation_bytes"] == 3 * 4 * 8 * 64 * 4
    host_activations = planned["activation_bytes"] if activation_offload else 0
    assert engine.store.host_bytes() == planned["host_bytes"] - host_activations


def test_a_cpu_device_lends_offloaded_variables_and_counts_them_as_copies():
    """On a CPU device, host memory is device memory: with offload on, a load hands out the stored tensors
    themselves, a save of a tensor changed in place copies nothing, and a fresh gradient becomes the stored
    one; the counters and the ledger count exactly what a copy would have moved and held."""
    from ipuft.components import Init, VariableSpec
    from ipuft.engine.store import VariableStore

    store = VariableStore(torch.device("cpu"), offload=True)
    specs = [VariableSpec("w", (4, 8), torch.float32, Init("normal", 1.0)), VariableSpec("b", (8,), torch.float32,
                                                                                         Init("zeros"))]
    store.allocate("u", "fwd", specs)
    store.allocate("u", "grad", [VariableSpec(s.name, s.shape, s.dtype, Init("zeros")) for s in specs])
    stored = dict(store.entries["u"]["fwd"])
    loaded = store.load("u", "fwd")
    assert all(loaded[n] is stored[n] for n in stored)
    assert store.traffic().h2d["fwd"] == store.device_resident == (32 + 8) * 4
    loaded["w"].add_(1.0)  # an update in place
    store.save("u", "fwd", {"w": loaded["w"]})
    assert store.traffic().d2h["fwd"] == 32 * 4 and store.entries["u"]["fwd"]["w"] is stored["w"]
    fresh = {"w": torch.ones(4, 8), "b": torch.full((8,), 2.0)}
    store.save("u", "grad", fresh)
    assert all(store.entries["u"]["grad"][n] is fresh[n] for n in fresh) and store.traffic().d2h["grad"] == 40 * 4
    view = torch.zeros(2, 8, 4).transpose(1, 2)[0]  # not a tensor of its own: copied into the stored one
    kept = store.entries["u"]["grad"]["w"]
    store.save("u", "grad", {"w": view})
    assert store.entries["u"]["grad"]["w"] is kept and torch.equal(kept, torch.zeros(4, 8))
    store.release(loaded)
    assert store.device_resident == 0 and store.device_peak == 40 * 4


def test_lent_offloaded_steps_equal_offload_off_bit_for_bit(hooks, make_config):
    """Lending instead of copying changes no result: offload on equals offload off, bit for bit, in every
    weight and optimizer state, with host and device optimizer placement."""
    for placement in ("device", "host"):
        on = make_engine(make_config(*EQUIVALENCE, f"execution.optimizer_placement={placement}"), hooks)
        off = make_engine(make_config(*EQUIVALENCE, "execution.offload=false"), hooks)
        for a, b in zip(run_engine(on, on.cfg), run_engine(off, off.cfg), strict=True):
            assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm)
        for group in ("fwd", "optim"):
            for unit, tensors in on.store.state(group).items():
                for n, t in tensors.items():
                    assert torch.equal(t, off.store.state(group)[unit][n]), (placement, group, unit, n)


@pytest.mark.parametrize("offload", [True, False])
def test_frozen_roles_train_like_the_reference_and_move_nothing_for_updates(hooks, make_config, offload):
    """model.freeze=[embeddings,head]: the decoder trains exactly as a reference whose embeddings and head
    have requires_grad=False; the frozen weights stay bit-identical; they have no gradient or optimizer
    state in the store, none of it moves, they take no part in the norm; and the counters equal the plan."""
    cfg = make_config(*EQUIVALENCE, "model.freeze=[embeddings,head]", f"execution.offload={offload}")
    engine = make_engine(cfg, hooks)
    initial = initial_weights(engine, cfg)
    frozen = [n for n in initial if n.startswith(("transformer.wte", "transformer.ln_f", "lm_head"))]
    assert len(frozen) == 5
    reference = reference_training(cfg, initial, frozen=frozen)
    planned = estimate(cfg, engine.parts, hooks)
    results = run_engine(engine, cfg)
    assert_matches(cfg, engine, results, reference, initial, frozen=frozen)
    for unit in ("embeddings", "head"):
        assert engine.store.entries[unit]["optim"] == {}
        assert engine.store.entries[unit].get("grad", {}) == {}
    for result in results:
        assert result.traffic == planned["traffic"]
    head_and_embeddings = sum(v.nbytes for role in ("embeddings", "head") for v in engine.parts.variables[role])
    assert planned["frozen_saves_bytes"] == 2 * head_and_embeddings + sum(
        v.nbytes for v in engine.parts.variables["head"])  # Adam's m and v for both, the head's stored gradient
    assert planned["frozen_parameters"] == head_and_embeddings // 4
    if offload:
        plain = make_config(*EQUIVALENCE)
        unfrozen = estimate(plain, build_model(plain, hooks), hooks)
        for group in ("optim", "grad"):  # exactly the frozen units' share is gone
            for direction in ("h2d", "d2h"):
                units = ("embeddings", "head") if group == "optim" else ("head",)
                share = sum(unfrozen["variables_bytes"][u][group] for u in units)
                assert planned["traffic"][direction][group] == unfrozen["traffic"][direction][group] - share


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_without_recompute_the_kept_graphs_are_counted_and_planned(hooks, make_config, precision):
    """recompute=false keeps L × GA micro-batches' saved tensors from the forward to the backward: the ledger
    counts them (graph_bytes), the plan measures them on the meta device (within a few percent in float32;
    an upper bound in bfloat16, whose CPU attention kernel saves less than the meta device's), the device
    peak includes them, and the step equals recompute=true's."""
    extra = ["model.precision=bfloat16", "training.stochastic_rounding=true"] if precision == "bfloat16" else []
    common = ["training.global_batch_size=4", "execution.offload=false", *extra]
    kept = make_engine(make_config(*common, "execution.recompute=false"), hooks)
    recomputed = make_engine(make_config(*common), hooks)
    planned = estimate(kept.cfg, kept.parts, hooks)
    for batch in batches(kept.cfg)[:2]:
        a, b = kept.step(batch, 1e-3), recomputed.step(batch, 1e-3)
        assert abs(a.loss - b.loss) <= 1e-6 * abs(b.loss) and abs(a.grad_norm - b.grad_norm) <= 1e-5 * b.grad_norm
        assert a.graph_bytes > 0 and b.graph_bytes == 0 and planned["graph_bytes"] >= a.graph_bytes
        assert a.device_peak_bytes >= b.device_peak_bytes  # the graphs are on the device at once
        if precision == "float32":  # (in bfloat16 the update's float32 transients are the larger peak)
            assert planned["graph_bytes"] <= 1.05 * a.graph_bytes
            assert a.device_peak_bytes > b.device_peak_bytes
    for key in ("offload", "activation_offload", "rts"):
        with pytest.raises(ConfigError, match=f"set execution.{key}=false with it"):
            make_config("execution.recompute=false", *(["execution.offload=false"] if key != "offload" else []),
                        f"execution.{key}=true")


def test_weight_traffic_does_not_depend_on_gradient_accumulation(hooks, make_config):
    weight = {}
    for gbs in (1, 8):
        cfg = make_config(f"training.global_batch_size={gbs}", "execution.activation_offload=true")
        assert cfg.gradient_accumulation == gbs
        result = make_engine(cfg, hooks).step(batches(cfg)[0], 1e-3)
        weight[gbs] = {d: {g: b for g, b in result.traffic[d].items() if g in ("fwd", "optim", "grad")}
                       for d in ("h2d", "d2h")}
        assert result.traffic["h2d"]["activation"] > 0
    assert weight[1] == weight[8]
    # Each decoder layer's weights cross host→device three times per step, whatever GA is.
    layer_fwd = sum(v.nbytes for v in make_engine(cfg, hooks).parts.variables["decoder"])
    emb = sum(v.nbytes for v in make_engine(cfg, hooks).parts.variables["embeddings"])
    head = sum(v.nbytes for v in make_engine(cfg, hooks).parts.variables["head"])
    assert weight[8]["h2d"]["fwd"] == 3 * cfg.model.layers * layer_fwd + 2 * emb + 2 * head


def test_device_peak_is_bounded_and_independent_of_depth(hooks, make_config):
    peaks = {}
    for layers in (2, 16):
        cfg = make_config(f"model.layers={layers}", "training.global_batch_size=4",
                          "execution.activation_offload=true")
        engine = make_engine(cfg, hooks)
        result = engine.step(batches(cfg)[0], 1e-3)
        peaks[layers] = result.device_peak_bytes
        parts = engine.parts
        size = {role: sum(v.nbytes for v in parts.variables[role]) for role in parts.variables}
        optim = {role: 2 * size[role] for role in size}  # adamw: m and v
        bound = (2 * 2 * size["decoder"] + unit_cost(parts, "decoder", cfg).saved_bytes
                 + size["embeddings"] * 2 + optim["embeddings"] + size["head"] * 2 + optim["head"])
        assert result.device_peak_bytes <= bound
    assert peaks[2] == peaks[16]


@pytest.mark.parametrize("overrides", [
    (),
    ("execution.offload=false",),
    ("execution.activation_offload=true", "execution.micro_batch_size=2"),
    ("model.precision=bfloat16", "training.stochastic_rounding=true", "training.master_weights=false"),
    ("execution.optimizer_placement=host",),
    ("model.freeze=[embeddings]", "training.global_batch_size=2"),
    ("model.tie_embeddings=true",),
    ("model.tie_embeddings=true", "model.precision=bfloat16", "training.stochastic_rounding=true"),
    ("model.tie_embeddings=true", "execution.optimizer_placement=host"),
])
def test_each_phase_holds_no_more_than_the_plan_declares_for_it(hooks, make_config, overrides):
    """Phase by phase, the ledger's peak above what the phase found on the device is what the plan declares
    the phase holds (ipuft.plan.memory.PhaseMemory): exactly, for a phase that updates without computing;
    for one that computes, at least what it loads and at most its declaration beside the buffered activations
    it may touch. The plan's holdings are per phase, as its moves are, not only a bound on the step."""
    from ipuft.plan.memory import resident_activation_bytes

    cfg = make_config("training.global_batch_size=4", *overrides)
    engine = make_engine(cfg, hooks)
    planned = {p["phase"]: p["device"] for p in estimate(cfg, engine.parts, hooks)["program"]}
    computes = {p.name: p.computes for p in engine.program}
    acts = resident_activation_bytes(cfg)
    for batch in batches(cfg)[:2]:
        measured = engine.step(batch, 1e-3).phase_peak_bytes
        assert set(measured) == set(planned)
        for name, held in planned.items():
            if not computes[name]:  # an update: the ledger counts exactly what the plan declares
                assert measured[name] == held["loaded"] + held["update"], (name, measured[name], held)
                continue
            # A compute's declaration is measured (every tensor alive, autograd's temporaries too), which the
            # ledger, counting what the engine holds by name, cannot see: it is bounded by it.
            bound = held["loaded"] + max(acts + held["compute"], held["update"])
            assert held["loaded"] <= measured[name] <= bound, (name, measured[name], held)
    assert any(held["compute"] > 0 for held in planned.values())


def test_dropout_masks_match_between_forward_and_recompute(hooks, make_config):
    """With dropout, the phased step's loss and gradient norm are those of the whole model run with the
    same per-unit, per-micro-batch masks: the recompute reproduces the forward's masks exactly."""
    from torch.func import functional_call

    cfg = make_config("model.dropout_prob=0.3", "training.global_batch_size=4", "execution.loss_scaling=8")
    engine = make_engine(cfg, hooks)
    weights = {u: {n: t.clone().requires_grad_() for n, t in w.items()} for u, w in engine.model.weights().items()}
    batch = batches(cfg)[0]
    result = engine.step(batch, 0.0)

    losses = []
    for mb in range(batch.micro_batches):
        with engine.compute.rng("embeddings", mb, engine.updates):
            h = functional_call(engine.modules["embeddings"], weights["embeddings"], (batch.input_ids[mb],))
        for n in range(cfg.model.layers):
            with engine.compute.rng(f"decoder.{n}", mb, engine.updates):
                h = functional_call(engine.modules["decoder"], weights[f"decoder.{n}"], (h,))
        losses.append(functional_call(engine.modules["head"], weights["head"], (h, batch.labels[mb])))
    loss = torch.stack(losses).mean()
    loss.backward()
    norm = math.sqrt(sum(float(t.grad.double().pow(2).sum()) for w in weights.values() for t in w.values()))
    assert result.loss == pytest.approx(loss.item(), rel=1e-6)
    assert result.grad_norm == pytest.approx(norm, rel=1e-5)
    without = make_engine(make_config("training.global_batch_size=4"), hooks).step(batch, 0.0)
    assert abs(without.loss - result.loss) > 1e-3  # dropout really was on


@pytest.mark.parametrize("recipe", [(), ("model.precision=bfloat16", "training.stochastic_rounding=true"),
                                    ("model.precision=bfloat16", "training.master_weights=true")],
                         ids=["float32", "bf16-sr", "bf16-master"])
def test_updates_in_pieces_equal_updates_of_whole_variables(hooks, make_config, monkeypatch, recipe):
    """The optimizer updates a unit in pieces of at most update_chunk elements, grouped across variables: with
    pieces of 1000 elements (every variable of the tiny model cut, small ones grouped) the weights and Adam's
    state after three steps are those of one call over whole variables, bit for bit."""
    import ipuft.engine.cuts

    cfg = make_config("training.global_batch_size=4", *recipe)
    states = {}
    whole = 1 << 40  # one call over every whole variable of a unit
    for chunk in (1000, whole):
        monkeypatch.setattr(ipuft.engine.cuts, "update_chunk", lambda device, c=chunk: c)
        engine = make_engine(cfg, hooks)
        for batch in batches(cfg)[:3]:
            engine.step(batch, 1e-2)
        states[chunk] = (engine.model.weights(), engine.store.state("optim"))
    for group in range(2):
        for unit, tensors in states[whole][group].items():
            for name, t in tensors.items():
                assert torch.equal(states[1000][group][unit][name], t), (unit, name)
    groups = list(ipuft.engine.cuts.update_groups([("a", 2500), ("b", 300), ("c", 1200)], 1000))
    assert groups == [[("a", 0, 1000)], [("a", 1000, 2000)], [("a", 2000, 2500), ("b", 0, 300), ("c", 0, 200)],
                      [("c", 200, 1200)]]
