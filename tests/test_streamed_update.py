"""The update streamed to the device piece by piece (ipuft.engine.streaming) is the update of the unit loaded
whole, bit for bit, holds only its pieces on the device, and is what the plan declares."""

import dist_workers
import pytest
import torch
from cli_helpers import run_cli
from distributed import spawn
from test_engine import batches, make_engine

from ipuft.engine.cuts import group_transient_bytes, update_groups
from ipuft.plan.estimate import estimate
from ipuft.precision import recipe

STEPS = 3
# Decay on (adamw decays weights, not biases and norms), clipping active, a loss scale to remove, GA=2.
COMMON = ("training.global_batch_size=4", "plugins.adamw.weight_decay=0.1", "training.optimizer.gradient_clipping=0.05",
          "execution.loss_scaling=8")
BF16_SR = ("model.precision=bfloat16", "training.stochastic_rounding=true")
SMALL = "execution.update_piece_bytes=6000"  # every variable of the tiny model in several pieces, small ones grouped


def trained(hooks, make_config, *overrides, multiple=None):
    cfg = make_config(*COMMON, *overrides)
    engine = make_engine(cfg, hooks)
    if multiple is not None:
        engine.optimizer.block_size = multiple  # pieces only: adamw keeps no block states
    results = [engine.step(batch, 1e-2) for batch in batches(cfg)[:STEPS]]
    return engine, results


def assert_same_state(a, b):
    for group in ("fwd", "optim"):
        left, right = a.store.state(group), b.store.state(group)
        assert left.keys() == right.keys()
        for unit, tensors in left.items():
            assert tensors.keys() == right[unit].keys()
            for name, t in tensors.items():
                assert torch.equal(t, right[unit][name]), (group, unit, name)


@pytest.mark.parametrize("recipe", [(), BF16_SR], ids=["float32", "bf16-sr"])
@pytest.mark.parametrize("multiple", [None, 64])
def test_streamed_update_equals_the_unit_update_bit_for_bit(hooks, make_config, recipe, multiple):
    """Pieces of at most 6000 bytes of weights, Adam state and gradient (a few hundred elements: every variable
    cut, small ones grouped; with an optimizer's block_size of 64, every piece starting on a multiple of 64):
    after three steps every weight and every optimizer state equal the unit update's, bit for bit."""
    whole, _ = trained(hooks, make_config, *recipe, "execution.update_piece_bytes=0")
    streamed, results = trained(hooks, make_config, *recipe, SMALL, multiple=multiple)
    assert not any(r.skipped for r in results)
    assert_same_state(streamed, whole)


@pytest.mark.parametrize("recipe", [(), BF16_SR], ids=["float32", "bf16-sr"])
def test_streamed_device_update_equals_the_host_update(hooks, make_config, recipe):
    """optimizer_placement=host updates in host memory, in place; the streamed device update reaches the same
    weights and state bit for bit (a CPU device: the same arithmetic)."""
    host, _ = trained(hooks, make_config, *recipe, "execution.optimizer_placement=host")
    streamed, _ = trained(hooks, make_config, *recipe, SMALL)
    assert_same_state(streamed, host)


@pytest.mark.parametrize("how", [(), BF16_SR], ids=["float32", "bf16-sr"])
def test_update_phases_hold_their_pieces_as_planned(hooks, make_config, how):
    """The plan's update phases hold one streamed call's pieces (no whole group), and the ledger's peak of each
    phase that only updates is exactly that; far below the unit's weights, Adam state and gradient, which the
    unit update loads."""
    cfg = make_config(*COMMON, *how, SMALL)
    engine = make_engine(cfg, hooks)
    planned = {p["phase"]: p["device"] for p in estimate(cfg, engine.parts, hooks)["program"]}
    whole_cfg = make_config(*COMMON, *how, "execution.update_piece_bytes=0")
    whole = {p["phase"]: p["device"] for p in estimate(whole_cfg, engine.parts, hooks)["program"]}
    for batch in batches(cfg)[:2]:
        measured = engine.step(batch, 1e-3).phase_peak_bytes
        for phase in engine.program:
            if not phase.updates or phase.computes:
                continue
            held = planned[phase.name]
            assert held["loaded"] == 0
            assert measured[phase.name] == held["update"] > 0, phase.name
            # one call's pieces (6000 bytes at most, so 500 elements at 12 bytes each at least) and its transients
            assert 6000 // 2 <= held["update"] <= 6000 + group_transient_bytes(recipe(cfg), [500])
            assert whole[phase.name]["loaded"] > 3 * held["update"]
    emb = planned["embeddings:backward+global_norm+optimizer_step"]
    weights = sum(t.numel() * t.element_size() for t in engine.store.entries["embeddings"]["fwd"].values())
    assert emb["loaded"] == weights  # its weights only: the state is streamed


def test_traffic_equals_the_unit_update_and_the_plan(hooks, make_config):
    """Streaming moves the same bytes in each direction as loading the unit whole: the plan's."""
    cfg = make_config(*COMMON, SMALL)
    engine = make_engine(cfg, hooks)
    planned = estimate(cfg, engine.parts, hooks)
    whole = make_engine(make_config(*COMMON, "execution.update_piece_bytes=0"), hooks)
    for batch in batches(cfg)[:2]:
        assert engine.step(batch, 1e-3).traffic == planned["traffic"] == whole.step(batch, 1e-3).traffic


def test_pieces_start_on_the_optimizers_multiple():
    groups = list(update_groups([("a", 250), ("b", 30), ("c", 120)], 100, multiple=64))
    assert groups == [[("a", 0, 64)], [("a", 64, 128)], [("a", 128, 192)], [("a", 192, 250), ("b", 0, 30)],
                      [("c", 0, 64)], [("c", 64, 120)]]
    for group in groups:
        assert all(start % 64 == 0 for _, start, _ in group)
        assert sum(stop - start for _, start, stop in group) <= 100
    # a chunk below the multiple is raised to it
    assert list(update_groups([("a", 200)], 10, multiple=64)) == [[("a", 0, 64)], [("a", 64, 128)],
                                                                   [("a", 128, 192)], [("a", 192, 200)]]


def test_a_negative_piece_size_is_one_line(capsys):
    code, _, err = run_cli(capsys, "plan", "--config", "tiny", "execution.update_piece_bytes=-1")
    assert code == 2
    assert err.strip() == "ipuft: error: execution.update_piece_bytes: must be >= 0, got -1"


def test_rts_dp2_streamed_equals_the_unit_update(hooks, tmp_path):
    """DP=2 with RTS, bfloat16 with stochastic rounding: each rank streams its 1/DP slices; the gathered weights
    and state equal the unit update's bit for bit (rounding keys on each element's index in the full variable)."""
    base = ["model.embedding.vocab_size=100", "execution.data_parallel=2", "execution.rts=true",
            "training.global_batch_size=4", "plugins.adamw.weight_decay=0.1", *BF16_SR]
    configs = {"streamed": [*base, SMALL], "whole": [*base, "execution.update_piece_bytes=0"]}
    spawn(2, dist_workers.train_configs, configs, STEPS, str(tmp_path), tmp=tmp_path)
    got = {name: torch.load(tmp_path / f"{name}.rank0.pt") for name in configs}
    assert got["streamed"]["losses"] == got["whole"]["losses"]
    for group in ("weights", "optim"):
        for unit, tensors in got["whole"][group].items():
            for name, t in tensors.items():
                assert torch.equal(got["streamed"][group][unit][name], t), (group, unit, name)
    for rank in range(2):
        mine = torch.load(tmp_path / f"streamed.rank{rank}.pt")
        assert mine["traffic"] == mine["planned"]
