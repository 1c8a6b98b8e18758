"""At GPT-J-6B's width: one decoder layer of hidden 4096 with GPT-J's embeddings and head (614M parameters, Adam)
trains in a process of its own, in float32 and in bfloat16, with micro-batches of one and four rows, and its
peak resident memory is between 90% and 100% of what ``ipuft plan`` says the run needs on this machine: the
plan is neither short nor padded. The slowest tests of the suite: about 10 GiB and half a minute each on the
2-core CI machine. The bfloat16 cases run only on a CPU with native bfloat16 matmuls: without them (AVX2) a
step at this width takes many minutes (about 44x float32's), and the store's 16-bit bytes are counted exactly
at small widths too (tests/test_precision.py, tests/test_tied.py)."""

import json
import subprocess
import sys

import pytest
import torch

from ipuft.kernels import fast_bfloat16

PARAMETERS = 614_290_656
EMBEDDING = 50400 * 4096  # the embeddings' gradient lives only within their backward-and-update phase: not stored
WIDE = ["--config", "tiny", "model.layers=1", "model.hidden_size=4096", "model.attention.heads=16",
        "model.attention.rotary_dim=64", "model.embedding.vocab_size=50400", "model.sequence_length=128",
        "execution.device=cpu", "training.steps=1", "checkpoint.save=null"]
PRECISIONS = {
    # The store: weights, the decoder's and head's gradients, and Adam's m and v, all float32.
    "float32": ([], 4 * (4 * PARAMETERS - EMBEDDING)),
    # bfloat16 weights and gradients, float32 m and v, stochastic rounding (no master copy).
    "bfloat16": (["model.precision=bfloat16", "training.stochastic_rounding=true"],
                 2 * PARAMETERS + 2 * (PARAMETERS - EMBEDDING) + 8 * PARAMETERS),
}


# ``ipuft ARGS`` with its own peak resident set (VmHWM) written to the file ARGV[1] when it ends. Not the child's
# ru_maxrss: the kernel carries the forking process's high-water mark into it across exec, so a pytest worker
# that once held 10 GiB (its earlier tests' heap) would show as this run's peak.
PEAK = """import sys
from ipuft.cli.main import main
path, sys.argv = sys.argv[1], ["ipuft", *sys.argv[2:]]
try:
    main()
finally:
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    open(path, "w").write(str(int(hwm.split()[1]) * 1024))
"""


def available_bytes() -> int:
    for line in open("/proc/meminfo").read().splitlines():  # noqa: SIM115
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def skip_slow_bfloat16(config: list[str]) -> None:
    """Skip a bfloat16 run where this CPU has no native bfloat16 matmul (the probe ``ipuft train`` warns by)."""
    if "model.precision=bfloat16" in config:
        fast, why = fast_bfloat16(torch.device("cpu"))
        if not fast:
            pytest.skip(f"{why} ({torch.backends.cpu.get_cpu_capability()}): a bfloat16 step at 6B width would "
                        f"take many minutes")


def train_wide(config: list[str], stored: int, out, spills: bool = False) -> tuple[dict, dict]:
    """Plan and train ``config`` in a process of its own; its plan and first metrics record, after checking
    that the plan's host bytes are ``stored`` (and, ``spills``, the buffers' share) and the peak RSS is
    between 90% and 100% of the plan's need."""
    skip_slow_bfloat16(config)
    plan = subprocess.run(["ipuft", "plan", *config, "--json"], capture_output=True, text=True, check=True)
    planned = json.loads(plan.stdout)
    needed = planned["machine"]["host_needed_bytes"]
    assert planned["parameters"] == PARAMETERS
    assert planned["host_bytes"] == stored + (planned["activation_bytes"] if spills else 0)
    if available_bytes() < needed * 1.1:
        pytest.skip(f"this machine has {available_bytes() / 2**30:.1f} GiB available; the run needs "
                    f"{needed / 2**30:.1f}")
    peak_file = out.parent / "peak"
    child = subprocess.run([sys.executable, "-c", PEAK, str(peak_file), "train", *config], check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert child.returncode == 0, child.stderr
    peak = int(peak_file.read_text())
    assert 0.90 * needed <= peak <= needed, (peak / 2**30, needed / 2**30, peak / needed)
    return planned, json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.slow
@pytest.mark.xdist_group("width")  # one at a time under -n (pyproject's --dist loadgroup): 10 GiB each
@pytest.mark.parametrize("micro_batch", [1, 4])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_a_6b_wide_layer_trains_within_90_to_100_percent_of_the_planned_host_memory(tmp_path, precision, micro_batch):
    overrides, stored = PRECISIONS[precision]
    config = [*WIDE, *overrides, f"execution.micro_batch_size={micro_batch}",
              f"training.global_batch_size={2 * micro_batch}", f"output_dir={tmp_path}/run"]
    planned, record = train_wide(config, stored, tmp_path / "run")
    assert record["model_flops_per_s"] * record["step_time_s"] == pytest.approx(planned["flops_per_step"]["model"])


@pytest.mark.slow
@pytest.mark.xdist_group("width")
def test_a_6b_wide_layer_spilling_to_disk_stays_within_90_to_100_percent_of_the_plan(tmp_path):
    """activation_offload=disk: the plan's host bytes hold 2·GA + 1 entries of the buffers, and the step writes
    the plan's disk bytes (the layer's input, GA=4 micro-batches of 128 float32 tokens)."""
    overrides, stored = PRECISIONS["float32"]
    config = [*WIDE, *overrides, "execution.micro_batch_size=1", "training.global_batch_size=4",
              "execution.activation_offload=disk", f"execution.spill_dir={tmp_path}/spill", f"output_dir={tmp_path}/run"]
    planned, record = train_wide(config, stored, tmp_path / "run", spills=True)
    assert record["spill_written_bytes"] == record["spill_read_bytes"] == planned["disk_bytes"] == 4 * 128 * 4096 * 4
    assert list((tmp_path / "spill").iterdir()) == []
