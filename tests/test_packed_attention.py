"""Packed rows whose examples are kept apart (``Batch.positions``) train as the examples one per row: the same
loss and every gradient through the real engine (GPT-J with either attention kernel, Llama with grouped-query
attention, 16-bit, TP=2 and DP=2), the same logits as transformers given each example's positions and a
block-diagonal mask, and the eval loss; the attention's mask is in the plan's measured memory."""

from pathlib import Path

import pytest
import torch
from distributed import spawn
from hf_reference import hf_units
from llama_reference import save_hf
from test_engine import max_rel
from test_parity_hf import ipuft_forward

from ipuft.attention import example_mask, examples_apart, packed_positions
from ipuft.components import IGNORE_INDEX
from ipuft.config import load_config
from ipuft.data.batch import Batch
from ipuft.engine.model import build_model
from ipuft.engine.phased import micro_batch_positions
from ipuft.plan.estimate import estimate
from ipuft.plan.measure import packs_examples, unit_cost
from ipuft.plugins import create_plugin_manager
from ipuft.run.runtime import build_engine

T = 16
# Each micro-batch's packed rows, as the lengths of the examples packed in each (the rest of a row is padding).
# Micro-batch 1 mixes a packed row with a row of one example that fills it.
PACKED = [[[5, 4, 6], [7, 9]], [[3, 8, 2], [16]]]
GPTJ = ("model.sequence_length=16", "model.layers=2", "execution.loss_scaling=8")
LLAMA = ("model.layers=2", "model.hidden_size=64", "model.intermediate_size=96", "model.attention.heads=4",
         "model.attention.rotary_dim=16", "model.embedding.vocab_size=128", "model.bos_token_id=1",
         "model.eos_token_ids=[2]", "model.sequence_length=16", "plugins.llama.kv_heads=2",
         "model.precision=float32", "training.stochastic_rounding=false", "execution.activation_offload=false")
PRESETS = {"gptj": ("tiny", GPTJ), "llama": ("llama3-8b", LLAMA)}


def examples(vocab: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """Each micro-batch's examples (token ids), in the order :data:`PACKED` packs them."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(3, vocab, (n,), generator=g) for row in mb for n in row] for mb in PACKED]


def _row(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row of ``parts`` packed: ids, labels (each example's next tokens; its last token and the padding
    predict nothing) and positions (each example from 0, and the padding as one more)."""
    ids, labels, positions = [], [], []
    for e in parts:
        ids.append(e)
        labels.append(torch.cat([e[1:], torch.tensor([IGNORE_INDEX])]))
        positions.append(torch.arange(len(e)))
    pad = T - sum(len(e) for e in parts)
    if pad:
        ids.append(torch.zeros(pad, dtype=torch.int64))
        labels.append(torch.full((pad,), IGNORE_INDEX))
        positions.append(torch.arange(pad))
    return torch.cat(ids), torch.cat(labels), torch.cat(positions)


def packed_batch(vocab: int, with_positions: bool = True) -> Batch:
    """:data:`PACKED`'s rows, ``[GA=2, 2, T]``, with their positions (or without: the examples then see each
    other, as plain packing has them)."""
    rows, ex = [], examples(vocab)
    for mb, lengths in zip(PACKED, ex):
        it = iter(lengths)
        rows.append([_row([next(it) for _ in row]) for row in mb])
    ids, labels, positions = (torch.stack([torch.stack([r[k] for r in mb]) for mb in rows]) for k in range(3))
    return Batch(ids, labels, positions if with_positions else None)


def one_per_row(vocab: int) -> Batch:
    """The same examples one per row, ``[GA=2, 5, T]`` (micro-batch 1's fifth row is all padding, which no
    label of counts), without positions."""
    rows = [[_row([e])[:2] for e in mb] for mb in examples(vocab)]
    rows[1].append((torch.zeros(T, dtype=torch.int64), torch.full((T,), IGNORE_INDEX)))
    ids, labels = (torch.stack([torch.stack([r[k] for r in mb]) for mb in rows]) for k in range(2))
    return Batch(ids, labels)


def config(hooks, family: str, rows: int, *extra: str):
    preset, overrides = PRESETS[family]
    return load_config(preset, [*overrides, f"execution.micro_batch_size={rows}",
                                f"training.global_batch_size={2 * rows}", *extra], hooks.registrations.config_sections)


def first_step(cfg, hooks, batch: Batch) -> tuple[float, float, dict]:
    """One step of a fresh engine over ``batch``: loss, gradient norm, and every unit's gradient."""
    engine = build_engine(cfg, hooks)
    grads = {}
    taken = engine.compute.gradients

    def keep(phase, *args, **kwargs):
        out = taken(phase, *args, **kwargs)
        grads[phase.unit] = {n: g.float().clone() for n, g in out.items()}
        return out

    engine.compute.gradients = keep
    result = engine.step(batch, 1e-3)
    return result.loss, result.grad_norm, grads


def largest_difference(ours, reference) -> float:
    """The largest :func:`max_rel` of a gradient of ``ours`` from ``reference``'s."""
    return max(max_rel(g, reference[2][u][n]) for u, named in ours[2].items() for n, g in named.items())


def assert_same_step(ours, reference, tolerance: float) -> None:
    (loss, norm, grads), (ref_loss, ref_norm, ref_grads) = ours, reference
    assert abs(loss - ref_loss) <= tolerance * abs(ref_loss), (loss, ref_loss)
    assert abs(norm - ref_norm) <= tolerance * ref_norm, (norm, ref_norm)
    assert grads.keys() == ref_grads.keys() and len(grads) == 4  # embeddings, 2 layers, head
    for unit, named in grads.items():
        assert named.keys() == ref_grads[unit].keys()
        for name, g in named.items():
            assert max_rel(g, ref_grads[unit][name]) <= tolerance, (unit, name, max_rel(g, ref_grads[unit][name]))


@pytest.mark.parametrize(("family", "extra"), [
    ("gptj", ()), ("gptj", ("plugins.gptj_decoder.attention_kernel=eager",)), ("gptj", ("execution.recompute=false", "execution.offload=false")),
    ("llama", ()),
])
def test_packed_examples_train_as_the_examples_one_per_row(hooks, family, extra):
    """float32: the loss, the gradient norm and every gradient agree to 1e-5; the same rows without positions
    (each token attending over the whole row) differ by 0.9 of a gradient's largest element."""
    packed_cfg, reference_cfg = config(hooks, family, 2, *extra), config(hooks, family, 5, *extra)
    vocab = packed_cfg.model.embedding.vocab_size
    reference = first_step(reference_cfg, hooks, one_per_row(vocab))
    assert_same_step(first_step(packed_cfg, hooks, packed_batch(vocab)), reference, 1e-5)
    crossing = first_step(packed_cfg, hooks, packed_batch(vocab, with_positions=False))
    assert largest_difference(crossing, reference) > 0.5


@pytest.mark.parametrize(("family", "extra"), [("llama", ()), ("gptj", ("plugins.gptj_decoder.attention_kernel=eager",))])
def test_16_bit_packed_examples_train_as_the_examples_one_per_row(hooks, family, extra):
    """bfloat16 (weights and compute, float32 Adam state) against the same examples one per row in bfloat16.
    Each gradient is summed in float32 over the tokens and rounded to bfloat16 once: summed in another order
    (other rows, other matmul shapes), an element may round the other way, by one bfloat16 unit of itself (2^-8
    of it at most). Measured (AVX512 + AMX): 7e-5 of the largest element for Llama (sdpa), 6e-4 for GPT-J
    (eager), the losses equal; examples that see each other differ by 0.96."""
    extra = ("model.precision=bfloat16", "training.stochastic_rounding=true", *extra)
    packed_cfg, reference_cfg = config(hooks, family, 2, *extra), config(hooks, family, 5, *extra)
    reference = first_step(reference_cfg, hooks, one_per_row(128))
    ours = first_step(packed_cfg, hooks, packed_batch(128))
    assert_same_step(ours, reference, 2**-8)
    crossing = first_step(packed_cfg, hooks, packed_batch(128, with_positions=False))
    assert largest_difference(crossing, reference) > 2**-2


def test_positions_are_checked_and_rows_of_one_example_take_the_plain_path():
    """The step's check of a batch's positions, the micro-batches that keep the plain causal path, the mask, and
    what a decoder of its own reads inside examples_apart."""
    batch = packed_batch(128)
    second = batch.positions[1]
    with examples_apart(second):
        assert packed_positions() is second
    assert packed_positions() is None
    per_mb = micro_batch_positions(batch)
    assert all(torch.equal(p, batch.positions[mb]) for mb, p in enumerate(per_mb))
    plain = Batch(batch.input_ids, batch.labels, torch.arange(T).expand(2, 2, T).clone())
    assert micro_batch_positions(plain) == [None, None]
    with pytest.raises(ValueError, match="expected input_ids' shape"):
        micro_batch_positions(Batch(batch.input_ids, batch.labels, batch.positions[:, :1]))
    for bad in (batch.positions + 1, batch.positions.flip(-1)):
        with pytest.raises(ValueError, match="each row starts at 0"):
            micro_batch_positions(Batch(batch.input_ids, batch.labels, bad))
    # Block-diagonal causal: tokens 0-4 are one example, 5-8 the next.
    mask = example_mask(batch.positions[0, :1])[0, 0]
    assert mask[6].tolist() == [False] * 5 + [True, True] + [False] * 9
    assert mask[4].tolist() == [True] * 5 + [False] * 11


def test_the_eval_loss_of_packed_rows_is_that_of_the_examples_one_per_row(hooks):
    """``ipuft eval``'s pass (:class:`ipuft.engine.inference.LayerMajor`) keeps a packed row's examples apart: the
    same sum of token losses over the same tokens; inside ``examples_apart``, a call with a KV cache (generation)
    ignores the positions."""
    from ipuft.attention import CausalSelfAttention, HalvesRotary
    from ipuft.engine.inference import LayerMajor
    from ipuft.generate import LayerKVCache
    from ipuft.run.runtime import inference_engine

    cfg = config(hooks, "llama", 2)
    runner = LayerMajor(inference_engine(cfg, hooks))
    packed, alone = packed_batch(128), one_per_row(128)
    ours = [runner.loss_sum(packed.input_ids[mb], packed.labels[mb], packed.positions[mb]) for mb in range(2)]
    theirs = [runner.loss_sum(alone.input_ids[mb], alone.labels[mb]) for mb in range(2)]
    for (a, n), (b, m) in zip(ours, theirs):
        assert n == m and abs(float(a) - float(b)) <= 1e-5 * abs(float(b))
    crossing = runner.loss_sum(packed.input_ids[0], packed.labels[0])[0]
    assert abs(float(crossing) - float(theirs[0][0])) > 1e-3 * abs(float(theirs[0][0]))
    attention = CausalSelfAttention(32, 4, 8, HalvesRotary(8, 8))
    h = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = attention(h, LayerKVCache())
        with examples_apart(packed.positions[0]):
            assert torch.equal(attention(h, LayerKVCache()), plain)
            assert not torch.allclose(attention(h), plain)


def test_logits_match_transformers_given_positions_and_a_block_diagonal_mask(hooks, tmp_path):
    """A packed row's logits equal transformers' Llama given the row's position_ids and a 4-D mask (0 where a
    token sees a key, -inf elsewhere), and the examples' logits each on its own."""
    hf, src = save_hf(tmp_path, "llama", seed=3)
    cfg = load_config(None, [f"model.hf_checkpoint={src}", "model.sequence_length=16"],
                      hooks.registrations.config_sections)
    parts = build_model(cfg, hooks)
    units = hf_units(parts.modules, 2, {k: v.detach().clone() for k, v in hf.state_dict().items()})
    batch = packed_batch(101)
    ids, positions = batch.input_ids[0], batch.positions[0]
    with torch.no_grad(), examples_apart(positions):
        ours = ipuft_forward(parts, units, ids)
    additive = torch.zeros(2, 1, T, T).masked_fill(~example_mask(positions), float("-inf"))
    with torch.no_grad():
        theirs = hf(ids, position_ids=positions, attention_mask=additive).logits
        alone = hf(ids[0, 5:9][None]).logits[0]
    assert max_rel(ours, theirs) <= 1e-5
    assert max_rel(ours[0, 5:9], alone) <= 1e-5


def _packed_runs(rank: int, runs: dict[str, tuple[str, list[str]]], out: str) -> None:
    """Each run ``name: (family, overrides)``: two steps over :func:`packed_batch` at its layout (rank ``r`` of DP
    takes micro-batch ``r``); rank 0 saves the losses, norms and the first step's gathered first moments
    (:func:`first_moments`)."""
    hooks = create_plugin_manager()
    for name, (family, overrides) in runs.items():
        cfg = config(hooks, family, 2, *overrides)
        engine = build_engine(cfg, hooks)
        batch = packed_batch(cfg.model.embedding.vocab_size)
        dp, r = engine.layout.data_parallel, engine.layout.dp_rank
        mine = Batch(*(t[r::dp].contiguous() for t in (batch.input_ids, batch.labels, batch.positions)))
        results = [engine.step(mine, 1e-3)]
        moments = first_moments(engine)
        results.append(engine.step(mine, 1e-3))
        if rank == 0:
            torch.save({"losses": [x.loss for x in results], "norms": [x.grad_norm for x in results],
                        "moments": moments}, Path(out) / f"{name}.pt")


def first_moments(engine) -> dict[str, torch.Tensor]:
    """Adam's first moment of every variable, gathered: after one step, a multiple of its (clipped) gradient, so
    that it compares every gradient. (The weights, or the moments after two steps, would not, to 1e-5: Adam
    divides a near-zero gradient by its own magnitude, which turns its roundings into the update.)"""
    return {f"{u}.{n}": t for u, named in engine.model.full_weights("optim").items() for n, t in named.items()
            if n.endswith(".m")}


# name: (family, the layout's overrides, the model's overrides that one process shares)
LAYOUTS = {"gptj_tp2": ("gptj", ["execution.tensor_parallel=2"], []),
           "llama_tp2_kv_replicated": ("llama", ["execution.tensor_parallel=2"], ["plugins.llama.kv_heads=1"]),
           "llama_dp2": ("llama", ["execution.data_parallel=2"], []),
           "gptj_dp2_rts": ("gptj", ["execution.data_parallel=2", "execution.rts=true"], [])}


def test_packed_examples_under_tp_and_dp_equal_one_process(hooks, tmp_path):
    """Two steps with TP=2 (heads sharded; Llama's one key/value head replicated) or DP=2 (each rank one
    micro-batch's rows; with RTS) give one process's losses and gradient norms, and the first step's every
    gradient (Adam's first moments), to 1e-5."""
    runs = {name: (family, [*layout, *model]) for name, (family, layout, model) in LAYOUTS.items()}
    spawn(2, _packed_runs, runs, str(tmp_path), tmp=tmp_path)
    for name, (family, _, model) in LAYOUTS.items():
        theirs, single = torch.load(tmp_path / f"{name}.pt"), _single_run(hooks, family, model)
        for a, b in zip(theirs["losses"] + theirs["norms"], single["losses"] + single["norms"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (name, a, b)
        assert theirs["moments"].keys() == single["moments"].keys()
        for variable, m in single["moments"].items():
            assert max_rel(theirs["moments"][variable], m) <= 1e-5, (name, variable)


def _single_run(hooks, family, overrides):
    cfg = config(hooks, family, 2, *overrides)
    engine = build_engine(cfg, hooks)
    batch = packed_batch(cfg.model.embedding.vocab_size)
    results = [engine.step(batch, 1e-3)]
    moments = first_moments(engine)
    results.append(engine.step(batch, 1e-3))
    return {"losses": [x.loss for x in results], "norms": [x.grad_norm for x in results], "moments": moments}


def test_the_plan_counts_the_positions_and_measures_the_mask(hooks, monkeypatch):
    """Where a dataset's batches carry positions (examples packed whole), the plan's data traffic counts them,
    and the decoder's measured memory holds the attention's ``[B, 1, T, T]`` mask; the synthetic sample's and an
    unpacked dataset's carry none."""
    from ipuft.plan import estimate as plan
    from ipuft.plan import measure

    cfg = config(hooks, "gptj", 2)
    assert not packs_examples(cfg) and not packs_examples(config(hooks, "gptj", 2, "data.path=d.jsonl",
                                                                 "data.packing=false"))
    # The rule is the data's (ipuft.data.tokens.layout_of): chat and instruction rows pack whole by default,
    # text and template rows are cut into chunks unless data.whole_examples says otherwise.
    assert packs_examples(config(hooks, "gptj", 2, "data.path=d.jsonl", "data.format=chat"))
    assert packs_examples(config(hooks, "gptj", 2, "data.path=d.jsonl", "data.format=instruction"))
    assert not packs_examples(config(hooks, "gptj", 2, "data.path=d.jsonl", "data.format=text"))
    assert packs_examples(config(hooks, "gptj", 2, "data.path=d.jsonl", "data.format=text",
                                 "data.whole_examples=true"))
    parts = build_model(cfg, hooks)
    plain = (estimate(cfg, parts, hooks)["traffic"]["h2d"]["data"], unit_cost(parts, "decoder", cfg))
    for module in (measure, plan):
        monkeypatch.setattr(module, "packs_examples", lambda cfg: True)
    packed = (estimate(cfg, parts, hooks)["traffic"]["h2d"]["data"], unit_cost(parts, "decoder", cfg))
    assert (plain[0], packed[0]) == (2 * 2 * 2 * T * 8, 3 * 2 * 2 * T * 8)  # ids, labels (and positions), int64
    assert packed[1].saved_bytes - plain[1].saved_bytes >= 2 * T * T  # the bool mask, saved for the backward
    assert packed[1].forward == plain[1].forward


def test_a_packed_step_moves_and_keeps_what_the_plan_says(hooks, monkeypatch):
    """With recompute=false the kept graphs hold each layer's mask (and the rows without positions do not): the
    ledger counts them, the plan measures them (within 5%), and the step's counters equal the plan's traffic."""
    from ipuft.plan import estimate as plan
    from ipuft.plan import measure

    for module in (measure, plan):
        monkeypatch.setattr(module, "packs_examples", lambda cfg: True)
    cfg = config(hooks, "gptj", 2, "execution.recompute=false", "execution.offload=false")
    engine = build_engine(cfg, hooks)
    planned = estimate(cfg, engine.parts, hooks)
    packed = engine.step(packed_batch(128), 1e-3)
    crossing = engine.step(packed_batch(128, with_positions=False), 1e-3)
    assert packed.traffic == planned["traffic"]
    assert packed.graph_bytes - crossing.graph_bytes >= 2 * 2 * 2 * T * T  # layers × GA × [2, 1, T, T] bools
    assert packed.graph_bytes <= planned["graph_bytes"] <= 1.05 * packed.graph_bytes
