"""``execution.recompute`` and ``execution.offload`` ``auto`` (the finetune recipe's): the layout the plan
chooses against a machine's memory, on the plan alone (``ipuft.run.layout``), and what a run records."""

from __future__ import annotations

import json

import pytest
import yaml
from cli_helpers import run_cli
from llama_reference import save_hf

from ipuft.config import load_config
from ipuft.errors import ConfigError
from ipuft.run.layout import MARGIN, choose_layout

GIB = 2**30


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_hf(tmp_path_factory.mktemp("layout") / "llama", "llama")[1]


def recipe(hooks, checkpoint, *overrides):
    return load_config("finetune", [f"model.hf_checkpoint={checkpoint}", "model.sequence_length=16",
                                    "training.global_batch_size=4", *overrides], hooks.registrations.config_sections)


def memory(host=1 << 50, device=None):
    return {"host_available_bytes": host, "device_free_bytes": device, "process_bytes": 0, "disk_free_bytes": 1 << 50}


def layouts(hooks, cfg, mem):
    """Every allowed layout's needs, planned against ``mem``."""
    return {(e["recompute"], e["offload"]): e for e in choose_layout(cfg, hooks, mem, every=True)[1].planned}


def test_the_recipe_keeps_everything_where_it_fits_and_says_so(hooks, checkpoint):
    cfg = recipe(hooks, checkpoint)
    assert (cfg.execution.recompute, cfg.execution.offload) == ("auto", "auto")
    chosen, layout = choose_layout(cfg, hooks, memory())
    assert (chosen.execution.recompute, chosen.execution.offload) == (False, False) == (layout.recompute,
                                                                                         layout.offload)
    assert layout.line.startswith("execution.recompute=false, execution.offload=false (auto: its plan fits within "
                                  "80% of this machine's memory: host ")
    assert len(layout.planned) == 1  # the first layout that fits is taken unplanned beyond it


def test_each_layout_is_taken_where_the_faster_ones_do_not_fit(hooks, checkpoint):
    """On the host (a CPU device): the kept graphs' bytes decide between keeping and recomputing; on a device,
    a free memory under each faster layout's peak over the margin takes the next one, and recompute with
    offload where none fits: a test on the plan alone."""
    cfg = recipe(hooks, checkpoint)
    host = layouts(hooks, cfg, memory())
    keep, resident = host[False, False]["host_needed_bytes"], host[True, False]["host_needed_bytes"]
    assert keep > resident  # the graphs
    between = int((keep + resident) / 2 / MARGIN)
    layout = choose_layout(cfg, hooks, memory(host=between))[1]
    assert (layout.recompute, layout.offload) == (True, False)

    on_device = layouts(hooks, cfg, memory(device=1 << 50))
    peaks = {k: e["device_needed_bytes"] for k, e in on_device.items()}
    assert peaks[False, False] > peaks[True, False] > peaks[True, True]
    for free, expected in ((int(peaks[False, False] / MARGIN) + 1, (False, False)),
                           (int(peaks[False, False] / MARGIN) - 1, (True, False)),
                           (int(peaks[True, False] / MARGIN) - 1, (True, True)), (1, (True, True))):
        chosen, layout = choose_layout(cfg, hooks, memory(device=free))
        assert (layout.recompute, layout.offload) == expected == (chosen.execution.recompute,
                                                                  chosen.execution.offload), free
    assert "no faster layout's plan fits" in choose_layout(cfg, hooks, memory(device=1))[1].line


def test_a_key_set_stays_set_and_constrains_the_other(hooks, checkpoint):
    cfg = recipe(hooks, checkpoint, "execution.recompute=true")
    chosen, layout = choose_layout(cfg, hooks, memory())
    assert (chosen.execution.recompute, chosen.execution.offload) == (True, False)
    assert layout.line.startswith("execution.offload=false (auto: ")
    for extra in (["execution.offload=true"], ["execution.activation_offload=true"]):  # no graphs kept with them
        chosen, layout = choose_layout(recipe(hooks, checkpoint, *extra), hooks, memory())
        assert chosen.execution.recompute is True, extra
    host = recipe(hooks, checkpoint, "execution.optimizer_placement=host")  # updates where offload keeps them
    assert choose_layout(host, hooks, memory())[0].execution.offload is True
    plain = recipe(hooks, checkpoint, "execution.recompute=true", "execution.offload=true")
    assert choose_layout(plain, hooks, memory()) == (plain, None)


def test_more_than_one_process_recomputes_and_offloads_without_planning(hooks, checkpoint):
    cfg = recipe(hooks, checkpoint, "execution.data_parallel=2")
    chosen, layout = choose_layout(cfg, hooks, memory())
    assert (chosen.execution.recompute, chosen.execution.offload, chosen.execution.rts) == (True, True, True)
    assert layout.planned == [] and "2 processes" in layout.line


@pytest.mark.parametrize("key", ["recompute", "offload"])
def test_a_layout_value_that_is_none_of_them_is_one_line(hooks, checkpoint, key):
    with pytest.raises(ConfigError, match=rf"^execution.{key}: must be true, false or auto, got 'sometimes'$"):
        recipe(hooks, checkpoint, f"execution.{key}=sometimes")


def test_a_run_says_and_records_its_layout_and_plan_shows_each(capsys, checkpoint, tmp_path):
    code, out, err = run_cli(capsys, "plan", "--json", f"model.hf_checkpoint={checkpoint}",
                             "model.sequence_length=16")
    assert code == 0, err
    planned = json.loads(out)
    assert [(e["recompute"], e["offload"], e["chosen"]) for e in planned["layouts"]] == [
        (False, False, True), (True, False, False), (True, True, False)]
    assert (planned["offload"], planned["graph_bytes"] > 0) == (False, True)
    code, _, err = run_cli(capsys, "train", f"model.hf_checkpoint={checkpoint}", "model.sequence_length=16",
                           "training.steps=1", "training.global_batch_size=2", f"output_dir={tmp_path / 'run'}")
    assert code == 0, err
    assert "ipuft: execution.recompute=false, execution.offload=false (auto: " in err
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["execution"]
    assert (saved["recompute"], saved["offload"]) == (False, False)
