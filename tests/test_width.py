"""At GPT-J-6B's width: one decoder layer of hidden 4096 with GPT-J's embeddings and head (614M parameters,
float32, Adam) trains in a process of its own, and its peak resident memory stays within what ``ipuft plan``
says it needs, and above 80% of it (the plan is neither short nor padded). The slowest test of the suite:
about 10 GiB and half a minute on the 2-core CI machine."""

import json
import os
import subprocess

import pytest

WIDE = ["--config", "tiny", "model.layers=1", "model.hidden_size=4096", "model.attention.heads=16",
        "model.attention.rotary_dim=64", "model.embedding.vocab_size=50400", "model.sequence_length=128",
        "training.global_batch_size=2", "execution.micro_batch_size=1", "execution.device=cpu", "training.steps=1",
        "checkpoint.save=null"]


def available_bytes() -> int:
    for line in open("/proc/meminfo").read().splitlines():  # noqa: SIM115
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
def test_a_6b_wide_layer_trains_within_the_planned_host_memory(tmp_path):
    config = [*WIDE, f"output_dir={tmp_path}/run"]
    plan = subprocess.run(["ipuft", "plan", *config, "--json"], capture_output=True, text=True, check=True)
    planned = json.loads(plan.stdout)
    needed = planned["machine"]["host_needed_bytes"]
    assert planned["parameters"] == 614_290_656
    # The store: weights, gradients of the decoder and the head, and Adam's m and v, all float32.
    assert planned["host_bytes"] == 4 * (614_290_656 * 4 - 50400 * 4096)
    if available_bytes() < needed * 1.1:
        pytest.skip(f"this machine has {available_bytes() / 2**30:.1f} GiB available; the run needs "
                    f"{needed / 2**30:.1f}")
    child = subprocess.Popen(["ipuft", "train", *config], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    _, status, usage = os.wait4(child.pid, 0)
    err = child.stderr.read()
    child.stderr.close()
    assert os.waitstatus_to_exitcode(status) == 0, err
    peak = usage.ru_maxrss * 1024
    assert 0.8 * needed <= peak <= needed, (peak / 2**30, needed / 2**30)
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["model_flops_per_s"] * record["step_time_s"] == pytest.approx(planned["flops_per_step"]["model"])
