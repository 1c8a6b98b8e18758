"""``adamw8bit``: its data types are the paper's, its steps through the engine are a plain block-wise 8-bit Adam's
bit for bit, it trains as ``adamw`` does, its smaller state is what the plan counts, and it resumes and shards
(RTS) exactly."""

from __future__ import annotations

import math
import shutil

import dist_workers
import numpy as np
import pytest
import torch
from distributed import spawn
from test_resume import final_weights

import ipuft.engine.cuts as cuts
from ipuft.config import load_config
from ipuft.data.tokens import data_source
from ipuft.errors import ConfigError, PluginError
from ipuft.io.checkpoint import read_meta
from ipuft.plan.estimate import estimate
from ipuft.run.runtime import build_engine
from ipuft.run.schedule import learning_rate
from ipuft.run.train import replica_batch, train
from ipuft_optim_adamw8bit.quantize import dynamic_map

BLOCK = 256
STEPS = 5
# GA=4, clipping active (norms are well above 0.05), weight decay on, a loss scale to remove.
CLIPPED = ["training.optimizer.name=adamw8bit", "training.global_batch_size=8", "execution.micro_batch_size=2",
           "training.optimizer.gradient_clipping=0.05", "plugins.adamw8bit.weight_decay=0.1",
           "training.optimizer.learning_rate.maximum=3e-3", "execution.loss_scaling=64", f"training.steps={STEPS}"]


# ---- the reference: the paper's data types and block-wise quantization, written out plainly ----

def decode_byte(byte: int, signed: bool) -> float:
    """The value of one 8-bit pattern of the dynamic data type: [sign] zeros (the exponent 10^-zeros), an
    indicator 1, then linear fraction bits (bin midpoints of [0.1, 1]); the pattern with no indicator bit is 0,
    and its twin (negative zero, or unsigned 00000001) 1.0."""
    sign, rest, width = ((-1.0 if byte >> 7 else 1.0), byte & 0x7F, 7) if signed else (1.0, byte, 8)
    if signed and rest == 0:
        return 1.0 if sign < 0 else 0.0
    if not signed and rest <= 1:
        return float(rest)
    zeros = width - rest.bit_length()
    bits = width - 1 - zeros
    k = rest & ((1 << bits) - 1)
    return sign * 10.0**-zeros * (0.1 + 0.9 * (k + 0.5) / 2**bits)


def reference_map(signed: bool) -> torch.Tensor:
    return torch.tensor(sorted(decode_byte(b, signed) for b in range(256)), dtype=torch.float32)


def ref_quantize(x: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (nearest value by exact distance, the lower on a tie) and per-block absmax of flat ``x``."""
    codes, scales = [], []
    for blocks in (x[: x.numel() // BLOCK * BLOCK].view(-1, BLOCK), x[x.numel() // BLOCK * BLOCK :].view(1, -1)):
        if not blocks.numel():
            continue
        absmax = blocks.abs().amax(dim=1)
        scales.append(absmax)
        normalized = torch.where(absmax[:, None] > 0, blocks / absmax[:, None], 0.0).double().reshape(-1)
        # the two values around each element, by exact (float64) distance
        exact = values.double()
        upper = torch.searchsorted(exact, normalized).clamp(1, 255)
        lower = upper - 1
        nearer_lower = (normalized - exact[lower]).abs() <= (exact[upper] - normalized).abs()
        codes.append(torch.where(nearer_lower, lower, upper))
    return torch.cat(codes).to(torch.uint8), torch.cat(scales)


def ref_dequantize(codes: torch.Tensor, scales: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.cat([values[c.long()] * s for c, s in zip(codes.split(BLOCK), scales, strict=True)])


class Reference:
    """AdamW's arithmetic, op for op as ``adamw``'s step writes it, around 8-bit block-wise moments; float32
    moments for norms and biases, no weight decay on them. Square roots correctly rounded (numpy's: ATen's CPU
    ``sqrt`` is within an ulp, ``adamw`` corrects it)."""

    def __init__(self, cfg):
        self.o = cfg.plugins.adamw8bit
        self.maps = {"m": reference_map(True), "v": reference_map(False)}
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    @staticmethod
    def eightbit(name: str) -> bool:
        return "norm" not in name and "bias" not in name

    def update(self, name: str, w: torch.Tensor, g: torch.Tensor, lr: float, t: int) -> None:
        o, n = self.o, w.numel()
        s = self.state.setdefault(name, {"m": torch.zeros(n), "v": torch.zeros(n)} if not self.eightbit(name) else {
            k: torch.zeros(n, dtype=torch.uint8) for k in ("m", "v")} | {
            f"{k}_absmax": torch.zeros(math.ceil(n / BLOCK)) for k in ("m", "v")})
        if self.eightbit(name):
            m, v = (ref_dequantize(s[k], s[f"{k}_absmax"], self.maps[k]) for k in ("m", "v"))
        else:
            m, v = s["m"], s["v"]
        g, flat = g.reshape(-1), w.view(-1)
        m.mul_(o.beta1).add_(g * (1 - o.beta1))
        v.mul_(o.beta2).add_((g * g) * (1 - o.beta2))
        bias1, bias2 = 1 - o.beta1**t, 1 - o.beta2**t
        denom = torch.from_numpy(np.sqrt(v.clamp_min(2.0**-126).numpy())).div_(math.sqrt(bias2)).add_(o.eps)
        if self.eightbit(name):
            flat.mul_(1 - lr * o.weight_decay)
        flat.add_((m / denom) * (-lr / bias1))
        if self.eightbit(name):
            for k, x in (("m", m), ("v", v)):
                s[k], s[f"{k}_absmax"] = ref_quantize(x, self.maps[k])


def test_the_maps_are_the_dynamic_data_type():
    for signed in (True, False):
        values = dynamic_map(signed)
        assert values.numel() == 256 and torch.equal(values, reference_map(signed))
        assert torch.equal(values, values.unique())  # sorted, distinct
    assert dynamic_map(True)[0] == -dynamic_map(True)[-2] and dynamic_map(False)[0] == 0.0


def test_encoding_is_the_nearest_value_the_lower_on_a_tie():
    """Codebook.encode (tables by the float's top bits) against the exact nearest value, over floats of every
    magnitude in [-1, 1] and at, just above and just below every midpoint between neighbouring values."""
    from ipuft_optim_adamw8bit.quantize import Codebook

    g = torch.Generator().manual_seed(0)
    for signed in (True, False):
        values = reference_map(signed)
        mid = ((values[1:].double() + values[:-1].double()) / 2).float()
        x = torch.rand(1 << 16, generator=g) * torch.logspace(-12, 0, 1 << 16)
        x = torch.cat([x, mid, mid.nextafter(torch.tensor(2.0)), mid.nextafter(torch.tensor(-2.0)), values])
        x = torch.cat([x, -x]) if signed else x
        x = x.clamp(-1.0, 1.0)
        exact = values.double()
        upper = torch.searchsorted(exact, x.double()).clamp(1, 255)
        nearer_lower = (x.double() - exact[upper - 1]).abs() <= (exact[upper] - x.double()).abs()
        expected = torch.where(nearer_lower, upper - 1, upper).to(torch.uint8)
        assert torch.equal(Codebook(signed).encode(x), expected)


# ---- through the engine ----

def train_recording(cfg, hooks, steps):
    """Train ``steps`` steps; return the initial full weights, the finished gradient the optimizer got for each
    variable at each step (pieces put together) and each step's context, and the engine."""
    engine = build_engine(cfg, hooks)
    initial = engine.model.full_weights()
    grads: dict[int, dict[str, list[torch.Tensor]]] = {}
    contexts = {}
    step_unit = engine.optimizer.step_unit

    def recording(names, weights, finished, states, ctx):
        for name, g in zip(names, finished, strict=True):
            grads.setdefault(ctx.step, {}).setdefault(name, []).append(g.clone())
        contexts[ctx.step] = ctx
        step_unit(names, weights, finished, states, ctx)

    fused_step = engine.optimizer.fused_step

    def recording_fused(names, weights, grads_, states, ctx, roundings):  # the kernel multiplies by the factor
        finished = [g * ctx.grad_factor for g in grads_]
        done = fused_step(names, weights, grads_, states, ctx, roundings)
        if done:
            for name, g in zip(names, finished, strict=True):
                grads.setdefault(ctx.step, {}).setdefault(name, []).append(g)
            contexts[ctx.step] = ctx
        return done

    engine.optimizer.step_unit = recording
    engine.optimizer.fused_step = recording_fused
    data = data_source(cfg)
    for s in range(steps):
        engine.step(replica_batch(cfg, data, s, engine.layout), learning_rate(s, steps, cfg.training.optimizer.learning_rate))
    return initial, {t: {n: torch.cat(p) for n, p in g.items()} for t, g in grads.items()}, contexts, engine


def test_pieces_start_on_block_boundaries():
    """A piece ends inside its variable only on a block boundary; a group's room for less than a block closes it."""
    groups = list(cuts.update_groups([("a", 2500), ("b", 300), ("c", 1200)], 1024, BLOCK))
    assert groups == [[("a", 0, 1024)], [("a", 1024, 2048)], [("a", 2048, 2500), ("b", 0, 300), ("c", 0, 256)],
                      [("c", 256, 1200)]]
    assert list(cuts.update_groups([("a", 2500)], 1000)) == [[("a", 0, 1000)], [("a", 1000, 2000)],
                                                                     [("a", 2000, 2500)]]


@pytest.mark.parametrize(("chunk", "placement", "piece_bytes"),
                         [(None, "device", 0), (3 * BLOCK, "device", 0), (3 * BLOCK, "host", 0),
                          (None, "device", 6000)],
                         ids=["pieces-default", "pieces-of-768", "host-pieces-of-768", "streamed-6000-bytes"])
def test_engine_steps_equal_the_plain_reference(hooks, make_config, monkeypatch, chunk, placement, piece_bytes):
    """Codes and absmax identical, weights bit for bit; with pieces of 768 elements every variable but the
    norms is cut, across block boundaries of a group shared with the variable before; also updated in host
    memory (``execution.optimizer_placement=host``), and streamed to the device in pieces of about 6000 bytes
    (``execution.update_piece_bytes``: codes, absmax blocks, weights and gradients of some 1000 elements)."""
    if chunk is not None:
        monkeypatch.setattr(cuts, "update_chunk", lambda device: chunk)
    cfg = make_config(*CLIPPED, f"execution.optimizer_placement={placement}",
                      f"execution.update_piece_bytes={piece_bytes}")
    initial, grads, contexts, engine = train_recording(cfg, hooks, STEPS)
    assert all(ctx.global_norm > 4 * cfg.training.optimizer.gradient_clipping for ctx in contexts.values())
    ref = Reference(cfg)
    weights = {f"{u}.{n}": t.clone() for u, w in initial.items() for n, t in w.items()}
    for t in range(1, STEPS + 1):
        assert grads[t].keys() == weights.keys()
        for name, g in grads[t].items():
            ref.update(name, weights[name], g, contexts[t].lr, t)
    state = engine.model.full_weights("optim")
    eightbit = 0
    for unit, tensors in engine.model.full_weights().items():
        for n, w in tensors.items():
            name = f"{unit}.{n}"
            assert torch.equal(w, weights[name]), name
            assert not torch.equal(w, initial[unit][n]), name
            mine = {k: state[unit][f"{n}.{k}"] for k in ref.state[name]}
            assert mine["m"].dtype == (torch.uint8 if ref.eightbit(name) else torch.float32)
            for k, expected in ref.state[name].items():
                assert torch.equal(mine[k].reshape(-1), expected), f"{name}.{k}"
            eightbit += ref.eightbit(name)
    assert eightbit == 1 + 2 * 6 + 1  # the embedding, each layer's projections, the LM head's


def test_the_gradient_it_gets_is_the_clipped_unscaled_one(hooks, make_config):
    """The first step's gradient the optimizer got is the plain autograd reference's, loss scale removed and
    clipped to the global norm (weight decay and the no-decay rule are the reference update's, above)."""
    import torch.nn.functional as F
    from hf_reference import hf_gptj, hf_state

    cfg = make_config(*CLIPPED)
    initial, grads, contexts, engine = train_recording(cfg, hooks, 1)
    model = hf_gptj(cfg)
    model.load_state_dict(hf_state(engine.modules, cfg.model.layers, initial))
    batch = replica_batch(cfg, data_source(cfg), 0, engine.layout)
    for mb in range(batch.micro_batches):
        logits = model(batch.input_ids[mb]).logits
        (F.cross_entropy(logits.flatten(0, 1), batch.labels[mb].flatten()) / batch.micro_batches).backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    clip = cfg.training.optimizer.gradient_clipping
    assert norm > 4 * clip and abs(contexts[1].global_norm - norm) / norm < 1e-5
    expected = hf_state(engine.modules, cfg.model.layers, {
        u: {n: grads[1][f"{u}.{n}"].view_as(t) for n, t in w.items()} for u, w in initial.items()})
    for name, p in model.named_parameters():
        want = p.grad * clip / norm
        assert float((expected[name] - want).abs().max() / want.abs().max()) <= 1e-5, name


def test_bad_block_size_and_tensor_parallelism_are_one_line(hooks, make_config):
    with pytest.raises(ConfigError, match=r"^plugins.adamw8bit.block_size: must be one of 64, 128, 256, 512, "
                                          r"1024, 2048, 4096, got 100$"):
        hooks.registrations.build_optimizer(make_config("training.optimizer.name=adamw8bit",
                                                        "plugins.adamw8bit.block_size=100"))
    with pytest.raises(ConfigError, match=r"^plugins.adamw8bit.beta2: must be in \[0, 1\), got 1.0$"):
        hooks.registrations.build_optimizer(make_config("training.optimizer.name=adamw8bit", "plugins.adamw8bit.beta2=1"))
    from ipuft.engine.model import build_model

    cfg = make_config("training.optimizer.name=adamw8bit", "execution.tensor_parallel=2")
    with pytest.raises(PluginError, match=r"^optimizer state wte.weight.m_absmax of embeddings has shape \(16,\), not "
                                         r"its variable's \(64, 64\)"):
        build_model(cfg, hooks, hooks.registrations.build_optimizer(cfg))


# ---- memory: the plan's exact saving ----

def test_the_plan_counts_two_bytes_and_two_absmax_per_block(hooks, make_config):
    """Host bytes drop by exactly 8 − 2 bytes per 8-bit parameter, less 2 × 4 bytes per block of 256; the
    engine's store holds what the plan says."""
    plans = {}
    for name in ("adamw", "adamw8bit"):
        cfg = make_config(f"training.optimizer.name={name}")
        engine = build_engine(cfg, hooks)
        plans[name] = estimate(cfg, engine.parts, hooks)["host_bytes"]
        assert not cfg.execution.activation_offload and engine.store.host_bytes() == plans[name]
    saved = 0
    for role, specs in engine.parts.variables.items():
        units = cfg.model.layers if role == "decoder" else 1
        for v in specs:
            if Reference.eightbit(v.name):
                saved += units * (6 * v.numel - 8 * math.ceil(v.numel / BLOCK))
    # tiny: wte 128×64, per layer 4 × 64×64 + 2 × 256×64, the head's 128×64
    assert saved == 6 * (8192 + 2 * 49152 + 8192) - 8 * (32 + 2 * 192 + 32) == 688_128 - 3584
    assert plans["adamw"] - plans["adamw8bit"] == saved


# ---- checkpoints and RTS ----

MNLI = ["data.path=mnli-sample", "data.tokenizer=sample", "model.embedding.vocab_size=512",
        "model.sequence_length=32", "training.global_batch_size=4", "training.optimizer.learning_rate.maximum=1e-3",
        "training.optimizer.name=adamw8bit"]


def test_exact_resume_is_bit_identical(hooks, tmp_path):
    """2 steps, a checkpoint, 2 more resumed from it equal 4 steps: losses, weights and the uint8 state."""
    def run(*overrides):
        return train(load_config("tiny", [*MNLI, *overrides], hooks.registrations.config_sections), hooks,
                     progress=False)

    full = run("training.steps=4", f"output_dir={tmp_path}/full")
    run("training.steps=4", "checkpoint.steps=2", f"output_dir={tmp_path}/crashed")
    step2 = tmp_path / "step2"
    shutil.copytree(tmp_path / "crashed" / "checkpoints" / "step-00000002", step2)
    assert read_meta(step2)["step"] == 2
    _, optim = final_weights(step2)
    assert optim["decoder.0.mlp.fc_in.weight.m"].dtype == torch.uint8
    assert optim["decoder.0.mlp.fc_in.weight.v_absmax"].shape == (256 * 64 // BLOCK,)
    resumed = run("training.steps=4", f"checkpoint.load={step2}", f"output_dir={tmp_path}/resumed")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]
    for a, b in zip(final_weights(tmp_path / "full"), final_weights(tmp_path / "resumed"), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_rts_over_two_ranks_equals_one_process(hooks, tmp_path):
    """DP=2 with RTS, each rank storing half of every variable's codes and its blocks' absmax, equals one process
    bit for bit: weights, the full optimizer state, losses. Every sample is the same text and clipping is off,
    so DP=2 computes the very gradient one process does (its mean over two equal halves is exact; one thread,
    as each rank runs, so that the kernels' sums split alike): any difference would be the state's layout. A
    vocabulary of 516 makes the embedding 33024 elements, which RTS cuts at 16640, a block boundary (not 16512)."""
    text = tmp_path / "same.txt"
    text.write_text("the quick brown fox jumps over the lazy dog, again and again and again\n" * 64)
    base = ["training.optimizer.name=adamw8bit", "model.embedding.vocab_size=516", "execution.micro_batch_size=1",
            f"data.path={text}", "data.tokenizer=sample", "data.format=text", "data.packing=false",
            "model.sequence_length=48", "training.optimizer.gradient_clipping=1e9", "plugins.adamw8bit.weight_decay=0.1",
            "training.optimizer.learning_rate.maximum=2e-3", f"training.steps={STEPS}"]
    parallel = [*base, "execution.data_parallel=2", "training.global_batch_size=2", "execution.rts=true"]
    spawn(2, dist_workers.train_configs, {"rts": parallel}, STEPS, str(tmp_path), tmp=tmp_path)
    cfg = load_config("tiny", [*base, "training.global_batch_size=1"], hooks.registrations.config_sections)
    engine = build_engine(cfg, hooks)
    data = data_source(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses = [engine.step(replica_batch(cfg, data, s, engine.layout),
                              learning_rate(s, STEPS, cfg.training.optimizer.learning_rate)).loss for s in range(STEPS)]
    finally:
        torch.set_num_threads(threads)
    rts = torch.load(tmp_path / "rts.rank0.pt")
    assert rts["losses"] == losses
    assert rts["optim"]["embeddings"]["wte.weight.m"].dtype == torch.uint8
    for group, expected in (("weights", engine.model.full_weights()), ("optim", engine.model.full_weights("optim"))):
        for unit, tensors in expected.items():
            for n, t in tensors.items():
                assert torch.equal(rts[group][unit][n], t), f"{group} {unit}.{n}"
    assert engine.store.entries["embeddings"]["optim"]["wte.weight.m_absmax"].shape == (129,)
    for rank in range(2):
        mine = torch.load(tmp_path / f"rts.rank{rank}.pt")
        assert mine["host_bytes"] == mine["planned_host"]
