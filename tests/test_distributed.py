"""Data, tensor and replicated-tensor-sharded parallelism on Gloo ranks equal a single process."""

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import dist_workers
import pytest
import torch
from distributed import free_port, spawn
from hf_reference import hf_gptj
from test_engine import max_rel

from ipuft.config import load_config
from ipuft.data.tokens import data_source
from ipuft.run.runtime import build_engine
from ipuft.run.schedule import learning_rate
from ipuft.run.train import replica_batch

STEPS = 5
COMMON = ["model.embedding.vocab_size=100", "execution.micro_batch_size=1", "plugins.adamw.weight_decay=0.1",
          "training.optimizer.gradient_clipping=0.5", "training.optimizer.learning_rate.maximum=2e-3",
          "execution.loss_scaling=16", f"training.steps={STEPS}",
          # Adam divides by √v + eps, so near eps it amplifies float32 rounding in tiny gradients (the
          # summation order differs across layouts); 1e-4 keeps the comparison about the layout.
          "plugins.adamw.eps=1e-4"]


def layout_configs(dp, tp):
    """GA=2 on every replica, RTS on and off, offload (of the variables and the activations) on and off."""
    base = COMMON + [f"execution.data_parallel={dp}", f"execution.tensor_parallel={tp}",
                     f"training.global_batch_size={2 * dp}"]
    return {f"rts{int(rts)}_off{int(off)}": base + [f"execution.rts={rts}", f"execution.offload={off}",
                                                    f"execution.activation_offload={off}"]
            for rts in (True, False) for off in (True, False)}


def single_process(hooks, gbs, extra=()):
    cfg = load_config("tiny", COMMON + [f"training.global_batch_size={gbs}", *extra],
                      hooks.registrations.config_sections)
    engine = build_engine(cfg, hooks)
    data = data_source(cfg)
    results = [engine.step(replica_batch(cfg, data, s, engine.layout),
                           learning_rate(s, STEPS, cfg.training.optimizer.learning_rate)) for s in range(STEPS)]
    return [r.loss for r in results], [r.grad_norm for r in results], engine.model.full_weights()


def rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize(("dp", "tp"), [(2, 1), (1, 2), (2, 2)], ids=["dp2", "tp2", "dp2xtp2"])
def test_parallel_training_equals_one_process(hooks, tmp_path, dp, tp):
    configs = layout_configs(dp, tp)
    spawn(dp * tp, dist_workers.train_configs, configs, STEPS, str(tmp_path), tmp=tmp_path)
    losses, norms, weights = single_process(hooks, 2 * dp)
    assert norms[0] > 0.5  # clipping is active
    for name in configs:
        got = torch.load(tmp_path / f"{name}.rank0.pt")
        for a, b in zip(got["losses"], losses, strict=True):
            assert rel(a, b) <= 1e-5, name
        for a, b in zip(got["norms"], norms, strict=True):
            assert rel(a, b) <= 1e-5, name
        assert got["weights"].keys() == weights.keys()
        for unit, w in weights.items():
            for n, t in w.items():
                assert got["weights"][unit][n].shape == t.shape
                assert max_rel(got["weights"][unit][n], t) <= 1e-5, f"{name} {unit}.{n}"
        for rank in range(dp * tp):  # every rank's counters equal the plan
            mine = torch.load(tmp_path / f"{name}.rank{rank}.pt")
            assert mine["traffic"] == mine["planned"], (name, rank)
            assert mine["host_bytes"] == mine["planned_host"], (name, rank)
            # each TP rank buffers 1/TP of every activation: x[L+1][GA] of them at the peak
            assert mine["activation_bytes"] == 3 * 2 * 8 * 64 * 4 // tp == mine["planned_activation"], (name, rank)
            # one DP reduction per variable per step, after the micro-batch loop: not one per micro-batch
            assert mine["reductions_per_step"] == mine["variables"], (name, rank)


BF16_SR = ["model.precision=bfloat16", "training.stochastic_rounding=true"]


def test_bfloat16_stochastic_rounding_layouts_equal_one_process(hooks, tmp_path):
    """DP2, TP2 and DP2×TP2 with RTS, in bfloat16 with stochastic rounding: the rounding's bits follow each
    element, not the rank that holds it, so every layout rounds as one process does."""
    from test_precision import assert_16bit_close

    configs = {f"dp{dp}tp{tp}": COMMON + BF16_SR + [f"execution.data_parallel={dp}", f"execution.tensor_parallel={tp}",
                                                    f"training.global_batch_size={2 * dp}", "execution.rts=true"]
               for dp, tp in ((2, 1), (1, 2), (2, 2))}
    for name, overrides in configs.items():
        world = int(name[2]) * int(name[5])
        spawn(world, dist_workers.train_configs, {name: overrides}, STEPS, str(tmp_path), tmp=tmp_path)
        gbs = 2 * int(name[2])
        cfg = load_config("tiny", COMMON + BF16_SR + [f"training.global_batch_size={gbs}"],
                          hooks.registrations.config_sections)
        expected = single_process(hooks, gbs, BF16_SR)
        float32 = single_process(hooks, gbs)[2]
        got = torch.load(tmp_path / f"{name}.rank0.pt")
        results = [SimpleNamespace(loss=a, grad_norm=b) for a, b in zip(got["losses"], got["norms"], strict=True)]
        # Under TP each rank's partial output projection is rounded to bfloat16 before the sum (as Megatron's
        # layout does; CPU matmuls cannot return float32 from bfloat16 inputs), and under DP each rank's weight
        # gradient, taken over its own micro-batches, before the float32 mean over DP: one more rounding than
        # one process makes, so such a run is about as far from one process as a second bfloat16 computation.
        assert_16bit_close(cfg, results, got["weights"], expected, float32, torch.bfloat16, share=0.5)
        for rank in range(world):
            mine = torch.load(tmp_path / f"{name}.rank{rank}.pt")
            assert mine["traffic"] == mine["planned"], (name, rank)


def test_rts_shrinks_host_bytes_about_dp_fold(tmp_path):
    configs = {"rts": COMMON + ["execution.data_parallel=2", "training.global_batch_size=4", "execution.rts=true"],
               "no_rts": COMMON + ["execution.data_parallel=2", "training.global_batch_size=4", "execution.rts=false"]}
    spawn(2, dist_workers.train_configs, configs, 1, str(tmp_path), tmp=tmp_path)
    for rank in range(2):
        rts = torch.load(tmp_path / f"rts.rank{rank}.pt")
        full = torch.load(tmp_path / f"no_rts.rank{rank}.pt")
        assert rts["host_bytes"] == rts["planned_host"]
        assert 0.49 <= rts["host_bytes"] / full["host_bytes"] <= 0.51
        assert rts["traffic"]["h2d"]["fwd"] < 0.51 * full["traffic"]["h2d"]["fwd"]


def test_tp2_logits_equal_transformers(tmp_path):
    cfg = load_config("tiny", ["model.embedding.vocab_size=100", "model.layers=2"])
    hf = hf_gptj(cfg)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    overrides = ["model.embedding.vocab_size=100", "execution.tensor_parallel=2"]
    spawn(2, dist_workers.tp_logits, overrides, state, ids, str(tmp_path), tmp=tmp_path)
    with torch.no_grad():
        out = hf(ids, labels=ids)
    for rank in range(2):
        got = torch.load(tmp_path / f"logits.rank{rank}.pt")
        assert got["logits"].shape == out.logits.shape  # padded vocabulary rows are cut
        torch.testing.assert_close(got["logits"], out.logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(got["loss"], out.loss, atol=1e-6, rtol=1e-6)  # sharded cross-entropy


def test_dropout_seeds_agree_within_tp_and_differ_across_dp(hooks):
    from ipuft.engine.model import build_model
    from ipuft.engine.phased import PhasedEngine
    from ipuft.parallel import Layout

    cfg = load_config("tiny", ["model.dropout_prob=0.1", "execution.data_parallel=2", "execution.tensor_parallel=2",
                               "training.global_batch_size=4"], hooks.registrations.config_sections)
    parts = build_model(cfg, hooks)
    optimizer = hooks.registrations.optimizers.get("adamw").build(cfg)
    draws = {}
    for rank in range(4):  # ranks 0, 1 form DP replica 0's TP group; ranks 2, 3 replica 1's
        engine = PhasedEngine(cfg, parts, optimizer, torch.device("cpu"), Layout(2, 2, rank))
        engine.updates = 1
        with engine.compute.rng("decoder.0", 0, engine.updates):
            draws[rank] = torch.rand(8)
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[2], draws[3])
    assert not torch.equal(draws[0], draws[2])


def test_hf_checkpoint_streams_into_each_ranks_shards(hooks, tmp_path):
    from hf_reference import hf_state

    from ipuft.engine.model import build_model

    cfg = load_config("tiny", ["model.embedding.vocab_size=100"])
    model = hf_gptj(cfg, seed=7)
    model.save_pretrained(tmp_path / "hf")
    overrides = [f"model.hf_checkpoint={tmp_path / 'hf'}", "model.sequence_length=8", "training.global_batch_size=4",
                 "execution.data_parallel=2", "execution.tensor_parallel=2", "execution.rts=true"]
    spawn(4, dist_workers.hf_load, overrides, str(tmp_path), tmp=tmp_path)
    parts = build_model(load_config("tiny", ["model.embedding.vocab_size=100"], hooks.registrations.config_sections),
                        hooks)
    gathered = hf_state(parts.modules, cfg.model.layers, torch.load(tmp_path / "hf.rank0.pt")["weights"])
    for name, tensor in model.state_dict().items():
        assert torch.equal(gathered[name], tensor), name
    total = sum(t.numel() for t in model.state_dict().values())
    for rank in range(4):  # each rank holds about a quarter (TP × RTS), not a copy of the model
        assert torch.load(tmp_path / f"hf.rank{rank}.pt")["stored"] < 0.3 * total


def test_collectives_with_rank_dependent_values(tmp_path):
    spawn(2, dist_workers.collectives, str(tmp_path), tmp=tmp_path)
    for rank in range(2):
        r = float(rank + 1)
        got = torch.load(tmp_path / f"collectives.rank{rank}.pt")
        y, g = got["copy"]
        assert torch.equal(y, torch.full((3,), r)) and torch.equal(g, torch.full((3,), 3.0))
        y, g = got["reduce"]
        assert torch.equal(y, torch.full((3,), 3.0)) and torch.equal(g, torch.full((3,), r))
        y, g = got["gather"]
        assert torch.equal(y, torch.tensor([[1.0, 1.0, 2.0, 2.0]] * 2))
        assert torch.equal(g, torch.tensor([[0.0, 1.0], [0.0, 1.0]]) + 2 * rank)
        assert torch.equal(got["max"], torch.tensor([2.0, 2.0]))


def rank_env(rank, world, port):
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}


def test_world_size_mismatch_is_reported_on_every_rank(tmp_path):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "ipuft.cli.main", "train", "--config", "tiny",
                               "execution.data_parallel=3", "training.global_batch_size=3",
                               f"output_dir={tmp_path}/run"], env=rank_env(r, 2, port),
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 2
        assert err == ("ipuft: error: execution.data_parallel × execution.tensor_parallel = 3 × 1 = 3, but 2 "
                       "processes were launched; run torchrun --nproc-per-node=3 --no-python ipuft train ... "
                       "(or set the two keys to match the launch)\n")
    assert not (tmp_path / "run").exists()


def two_ranks_training(tmp_path, *overrides):
    """Two DP ranks of the console script training (for ever) into ``tmp_path/run``, once the first step is
    in its metrics."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ipuft.cli.main", "train", "--config", "tiny", "execution.data_parallel=2",
           "training.global_batch_size=2", "training.steps=1000000", *overrides, f"output_dir={out}"]
    port = free_port()
    procs = [subprocess.Popen(cmd, env=rank_env(r, 2, port), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    deadline = time.time() + 90
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size > 0):
        assert time.time() < deadline, "training never started"
        assert all(p.poll() is None for p in procs), procs[0].stderr.read()
        time.sleep(0.2)
    return procs


def test_a_dead_rank_stops_the_others_with_a_clear_error(tmp_path):
    procs = two_ranks_training(tmp_path)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.time()
    _, err = procs[0].communicate(timeout=60)
    assert time.time() - killed < 60
    assert procs[0].returncode == 1
    print(err)
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("ipuft: error: rank 0: a peer rank died or stopped responding")
    procs[1].wait()


def test_torchrun_end_to_end(hooks, tmp_path):
    """The README's launch: torchrun starts two ranks of the real console script."""
    overrides = ["training.global_batch_size=4", "training.steps=3", "training.optimizer.learning_rate.maximum=1e-3"]
    for attempt in range(3):  # the port is free when chosen, but a parallel test may take it first: try another
        out = tmp_path / f"run{attempt}"
        proc = subprocess.run(  # noqa: PLW1510 (the exit code is asserted below)
            ["torchrun", "--nproc-per-node=2", f"--master-port={free_port()}", "--no-python", "ipuft", "train",
             "--config", "tiny", "execution.data_parallel=2", *overrides, f"output_dir={out}"],
            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode == 0 or "address already in use" not in proc.stderr.lower():
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [__import__("json").loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # rank 0 alone writes
    cfg = load_config("tiny", overrides, hooks.registrations.config_sections)
    engine = build_engine(cfg, hooks)
    data = data_source(cfg)
    for s, r in enumerate(records):
        expected = engine.step(replica_batch(cfg, data, s, engine.layout), r["lr"])
        assert rel(r["loss"], expected.loss) <= 1e-5 and rel(r["grad_norm"], expected.grad_norm) <= 1e-5


def test_a_rank_with_another_config_is_refused_at_start(tmp_path):
    port = free_port()
    out = tmp_path / "run"
    base = [sys.executable, "-m", "ipuft.cli.main", "train", "--config", "tiny", "execution.data_parallel=2",
            "training.global_batch_size=2", f"output_dir={out}"]
    lrs = ["training.optimizer.learning_rate.maximum=1e-5", "training.optimizer.learning_rate.maximum=3e-4"]
    procs = [subprocess.Popen([*base, lrs[r]], env=rank_env(r, 2, port), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2, err
        assert err == ("ipuft: error: rank 1 resolved another config than rank 0: "
                       "training.optimizer.learning_rate.maximum is 0.0003 there, 1e-05 on rank 0; launch every rank "
                       "with the same --config and overrides\n")
    assert not out.exists()


def test_a_stopped_rank_makes_the_others_exit_within_the_collective_timeout(tmp_path):
    # A few seconds, yet above a starved rank's slowest step when the suite's other workers share the cores.
    procs = two_ranks_training(tmp_path, "execution.collective_timeout_s=8")
    try:
        procs[1].send_signal(signal.SIGSTOP)
        stopped = time.time()
        _, err = procs[0].communicate(timeout=60)
        assert time.time() - stopped < 8 + 20  # the timeout, and the time to report and exit
        assert procs[0].returncode == 1, err
        assert "Traceback" not in err
        assert err.splitlines()[-1].startswith("ipuft: error: rank 0: a peer rank died or stopped responding")
    finally:
        procs[1].send_signal(signal.SIGCONT)
        procs[1].kill()
        procs[1].wait()
