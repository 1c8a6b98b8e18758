"""ipuft bench --profile: where a step's time goes, by category; --trace: a Chrome trace with a range per phase.

Nothing here is timed against a bound: the tests check the breakdown's structure, that its categories
account for the measured step (their sum is at most the step and most of it), and which categories must
be empty or not."""

import json

import dist_workers
import pytest
from cli_helpers import run_cli
from distributed import spawn

from ipuft.profiling import CATEGORIES, OTHER, StepProfile, phase_kind, profiling, section, timed
from ipuft.program import Op, Phase

# GA=4 with the activations and the variables offloaded, so that every category but collectives has work.
TINY = ("--config", "tiny", "training.global_batch_size=4", "execution.activation_offload=true")


def check_breakdown(p, steps):
    assert p["steps"] == steps
    assert list(p["seconds"]) == list(p["share"]) == list(CATEGORIES)
    assert all(s >= 0 for s in p["seconds"].values())
    covered = sum(p["seconds"].values())
    assert covered <= p["step_s"]
    assert covered >= 0.75 * p["step_s"]  # Python between the phases is the rest
    assert p["other_s"] == pytest.approx(p["step_s"] - covered, rel=1e-9, abs=1e-12)
    assert sum(p["share"].values()) + p["other_share"] == pytest.approx(1.0)
    for category, seconds in p["seconds"].items():
        assert p["share"][category] == pytest.approx(seconds / p["step_s"])
    # Whole phases, their sections in: within the step, and most of it.
    assert 0.75 * p["step_s"] <= sum(s for kinds in p["phases"].values() for s in kinds.values()) <= p["step_s"]


def test_bench_profile_breaks_a_step_down(capsys):
    code, out, err = run_cli(capsys, "bench", *TINY, "--profile", "--json")
    assert code == 0, err
    result = json.loads(out)
    p = result["profile"]
    check_breakdown(p, 5)
    for category in ("forward", "loss_backward", "backward", "optimizer", "copies"):
        assert p["seconds"][category] > 0, category
    assert p["seconds"]["collectives"] == 0  # one process: no collective is ever called
    assert result["duration_s"] > 0  # the throughput still comes from the plain steps
    # The run's matmul before each profiled step and after the last: its rate over all of them, and each one's.
    rate = p["matmul_rate"]
    assert len(rate["samples"]) == 6 and all(r > 0 for r in rate["samples"])
    assert min(rate["samples"]) <= rate["flops_per_s"] <= max(rate["samples"])
    backward = p["phase_flops"]["decoder"]["backward"]
    assert backward["of_matmul_rate"] == pytest.approx(backward["flops_per_s"] / rate["flops_per_s"])
    assert backward["of_peak"] == pytest.approx(backward["flops_per_s"] / result["matmul_peak"]["flops_per_s"])


def test_bench_profile_prints_a_table(capsys):
    code, out, err = run_cli(capsys, "bench", *TINY, "--profile")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("Duration: ")
    assert lines[1].startswith("Model FLOPs: ") and "matmul's" in lines[1]
    assert lines[2] == "where a step's time goes (mean of 5 profiled steps):"
    categories = len(CATEGORIES) + 2
    assert [line.split("  ")[1].strip() for line in lines[3 : 3 + categories]] == [*CATEGORIES.values(), OTHER, "step"]
    assert lines[2 + categories].endswith("100.0%")
    assert lines[3 + categories].startswith("by phase")
    assert lines[-1].startswith("the matmul between the profiled steps: ") and lines[-1].count(",") >= 5
    by_phase = {line.split()[0]: line for line in lines[4 + categories : -1]}
    assert list(by_phase) == ["embeddings:forward", "decoder:forward", "head:loss_backward", "decoder:backward",
                              "embeddings:backward", "decoder:optimizer", "head:optimizer"]
    assert "GFLOP/s" in by_phase["decoder:backward"] and "of the matmul peak" in by_phase["decoder:backward"]
    assert "of its rate between the steps" in by_phase["decoder:backward"]
    assert "GFLOP/s" not in by_phase["decoder:optimizer"]  # elementwise work is not counted


def test_collectives_are_timed_under_data_parallelism(tmp_path):
    """DP=2 with RTS: the breakdown has collectives, and each rank writes its own trace."""
    spawn(2, dist_workers.bench_profile, ["execution.data_parallel=2", "training.global_batch_size=4"], str(tmp_path),
          tmp=tmp_path)
    for rank in range(2):
        p = json.loads((tmp_path / f"profile.rank{rank}.json").read_text())
        check_breakdown(p, 2)
        assert p["seconds"]["collectives"] > 0  # RTS gathers, reduce-scatters, the norm's and the loss's all-reduce
        names = {e.get("name") for e in json.loads((tmp_path / f"step.rank{rank}.json").read_text())["traceEvents"]}
        assert {"decoder.0:forward", "collectives"} <= names
    assert not (tmp_path / "step.json").exists()


def test_trace_is_a_chrome_trace_with_a_range_per_phase(capsys, tmp_path, hooks, make_config):
    from ipuft.engine.model import build_model

    path = tmp_path / "step.json"
    code, out, err = run_cli(capsys, "bench", *TINY, "--trace", str(path))
    assert code == 0, err
    assert out.splitlines()[-1] == f"wrote {path}"
    events = json.loads(path.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    program = build_model(make_config("training.global_batch_size=4"), hooks).program
    phases = [p.name for p in program]
    assert "decoder.1:backward" in phases and "head:loss_backward" in phases
    assert set(phases) <= names
    # One step: each phase once on the CPU's timeline (on CUDA, once more as a gpu_user_annotation).
    ranges = [e for e in events if e.get("name") in phases and e.get("cat") == "user_annotation"]
    assert sorted(e["name"] for e in ranges) == sorted(phases)
    assert all(e["ph"] == "X" and e["dur"] > 0 for e in ranges)
    assert {"copies", "optimizer"} <= names  # the sections inside the phases


def test_trace_into_a_missing_directory_is_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "bench", *TINY, "--trace", str(tmp_path / "nope" / "step.json"))
    assert code == 2
    assert err == f"ipuft: error: --trace {tmp_path / 'nope' / 'step.json'}: its directory does not exist\n"


def test_sections_count_exclusive_time_and_nothing_when_off():
    calls = []

    @timed("collectives")
    def collective():
        calls.append(1)

    collective()  # no profile active: called straight through, nothing recorded
    assert section("copies") is section("optimizer")  # the shared null context
    profile = StepProfile("cpu")
    with profiling(profile):
        with profile.section("backward"), section("copies"):
            collective()
        collective()
    assert len(calls) == 3
    assert all(s > 0 for c, s in profile.seconds.items() if c in ("backward", "copies", "collectives"))
    assert profile.seconds["forward"] == profile.seconds["optimizer"] == 0
    report = profile.report(total=sum(profile.seconds.values()), steps=1)
    assert report["other_s"] == pytest.approx(0, abs=1e-12)


@pytest.mark.parametrize(("ops", "kind"), [
    ((Op.FORWARD,), "forward"), ((Op.LOSS_BACKWARD,), "loss_backward"), ((Op.BACKWARD,), "backward"),
    ((Op.BACKWARD, Op.GLOBAL_NORM, Op.OPTIMIZER_STEP), "backward"), ((Op.OPTIMIZER_STEP,), "optimizer"),
])
def test_a_phase_counts_as_its_kind(ops, kind):
    assert phase_kind(Phase("decoder", 0, ops)) == kind
