"""Hostile input on the newest surfaces (issue 43): exports that cannot damage a checkpoint or leave a temporary,
optimizer states that cannot be misread on resume, config.json values checked where a family reads them, and
token rows shorter than the sequence. Each refusal is one line naming what is wrong, exit 2, no traceback, and
nothing on disk changed (a hash of every file under the test's directory before and after)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cli_helpers import run_cli, without_recipe
from test_bad_input import snapshot

from ipuft.config import load_config
from ipuft.plugins import create_plugin_manager
from ipuft.run.train import train


def refused(capsys, root: Path, *args: str) -> str:
    """``ipuft ARGS`` exits 2 with one ``ipuft: error:`` line, no traceback, and nothing under ``root`` changed;
    the line, without its prefix."""
    before = snapshot(root)
    code, _, err = run_cli(capsys, *args)
    err = without_recipe(err)
    assert code == 2 and err.startswith("ipuft: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert snapshot(root) == before
    return err.removeprefix("ipuft: error: ").rstrip("\n")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """One step of LoRA on the tiny preset, with its checkpoint: a run that exports both --hf and --adapter."""
    root = tmp_path_factory.mktemp("lora-run")
    hooks = create_plugin_manager()
    train(load_config("tiny", ["training.steps=1", "training.global_batch_size=2", f"output_dir={root}/run",
                               "model.adapter=lora", "plugins.lora.rank=2", "plugins.lora.targets=[q,v]"],
                      hooks.registrations.config_sections), hooks, progress=False)
    return root / "run"


# -- Exports -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["--hf", "--adapter"])
@pytest.mark.parametrize("place", ["checkpoint", "below-checkpoint", "run", "checkpoints-root", "link-into-run",
                                   "around-source"])
def test_an_export_never_writes_into_a_checkpoint_or_run(capsys, tmp_path, lora_run, option, place):
    """One function checks every export's target: inside (or at) a checkpoint or a run directory, through a link
    into one, or around the checkpoint it reads, it is one line and the run stays as it was."""
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    step = next((run / "checkpoints").glob("step-*"))
    link = tmp_path / "link"
    link.symlink_to(run)
    out = {"checkpoint": step, "below-checkpoint": step / "export", "run": run / "export",
           "checkpoints-root": run / "checkpoints", "link-into-run": link / "export", "around-source": tmp_path}[place]
    line = refused(capsys, tmp_path, "export", "--checkpoint", str(step), option, str(out))
    kind = "checkpoint" if place.startswith(("checkpoint", "below")) and place != "checkpoints-root" else \
        "run directory"
    if place == "around-source":
        assert line == (f"{option} {out} would write over {step}, which the export reads; choose a directory "
                        f"apart from it")
    else:
        inside = {"checkpoint": "is", "below-checkpoint": f"is inside {step},", "run": f"is inside {run},",
                  "checkpoints-root": f"is inside {run},", "link-into-run": f"is inside {run},"}[place]
        assert line == (f"{option} {out} {inside} an ipuft {kind}; an export never writes into one (it would no "
                        f"longer load): choose a directory outside it")


def test_an_export_through_a_link_to_an_empty_directory_leaves_nothing_beside_it(capsys, tmp_path, lora_run):
    """The link is followed: the export is written where it points, the link stays a link, and no .old- or
    .tmp- directory is left beside either (a second export over the first replaces it the same way)."""
    target, link = tmp_path / "exports" / "adapter", tmp_path / "adapter-link"
    target.mkdir(parents=True)
    link.symlink_to(target)
    for _ in range(2):
        code, out, err = run_cli(capsys, "export", "--checkpoint", str(lora_run), "--adapter", str(link))
        assert code == 0, err
        assert out == f"wrote {link}\n"
        assert link.is_symlink() and link.resolve() == target
        assert sorted(p.name for p in target.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter-link", "exports"]
        assert [p.name for p in target.parent.iterdir()] == ["adapter"]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])
@pytest.mark.parametrize("option", ["--hf", "--adapter"])
def test_an_interrupted_or_failed_export_leaves_nothing_and_keeps_the_earlier_one(capsys, tmp_path, lora_run,
                                                                                   monkeypatch, option, stop):
    """Interrupted (Ctrl-C) or failing as the new export replaces an earlier one, the earlier one is back in
    place, byte for byte, and no temporary is left."""
    import ipuft.io.export_dir as export_dir

    out = tmp_path / "out"
    option_out = ["--adapter", str(out)] if option == "--adapter" else ["--hf", str(out)]
    if option == "--adapter":
        assert run_cli(capsys, "export", "--checkpoint", str(lora_run), *option_out)[0] == 0
    else:
        out.mkdir()
    before = snapshot(tmp_path)
    replace = export_dir.os.replace

    def interrupted(src, dst):
        if Path(src).name.startswith(".out.tmp-") and Path(dst) == out:  # the new export taking its place
            raise stop(28, "No space left on device") if stop is OSError else stop()
        replace(src, dst)

    monkeypatch.setattr(export_dir.os, "replace", interrupted)
    code, _, err = run_cli(capsys, "export", "--checkpoint", str(lora_run), *option_out)
    if stop is KeyboardInterrupt:
        assert (code, err) == (130, "\nipuft: error: aborted\n")  # click's own Ctrl-C line
    else:
        assert code == 2 and err == (f"ipuft: error: {option} {out} cannot be written (No space left on device); "
                                     f"nothing was left behind\n")
    assert snapshot(tmp_path) == before


def test_hf_and_adapter_exports_into_one_place_are_one_line(capsys, tmp_path, lora_run):
    line = refused(capsys, tmp_path, "export", "--checkpoint", str(lora_run), "--hf", str(tmp_path / "m"),
                   "--adapter", str(tmp_path / "m" / "a"))
    assert line == f"export: --hf {tmp_path / 'm'} and --adapter {tmp_path / 'm' / 'a'} overlap; give each its " \
                   f"own directory"
