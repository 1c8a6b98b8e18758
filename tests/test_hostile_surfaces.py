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


@pytest.mark.parametrize("option", ["--hf", "--adapter", "--gguf"])
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


# -- Optimizer state ---------------------------------------------------------------------------------------------

EIGHT_BIT = ["training.optimizer.name=adamw8bit"]


@pytest.fixture(scope="module")
def eight_bit_run(tmp_path_factory):
    """One step of adamw8bit on the tiny preset, with its checkpoint (8-bit moments for its large variables)."""
    root = tmp_path_factory.mktemp("adamw8bit-run")
    hooks = create_plugin_manager()
    train(load_config("tiny", ["training.steps=1", "training.global_batch_size=2", f"output_dir={root}/run",
                               *EIGHT_BIT], hooks.registrations.config_sections), hooks, progress=False)
    return root / "run"


def _run_copy(tmp_path: Path, run: Path) -> tuple[Path, Path]:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy, next((copy / "checkpoints").glob("step-*"))


@pytest.mark.parametrize("allowed", [False, True], ids=["plain", "allow-changes"])
@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "old-checkpoint"])
def test_an_adamw8bit_run_resumed_with_adamw_is_refused(capsys, tmp_path, eight_bit_run, allowed, recorded):
    """meta.json names the optimizer whose state the checkpoint holds (an older checkpoint: its saved config's
    training.optimizer.name); another optimizer never resumes from it, checkpoint.allow_changes or not, and the
    line says how to start one from the run's weights."""
    import json

    from test_bad_input import _reseal

    run, step = _run_copy(tmp_path, eight_bit_run)
    meta = json.loads((step / "meta.json").read_text())
    assert meta["optimizer"] == "adamw8bit"
    if not recorded:
        del meta["optimizer"]
        (step / "meta.json").write_text(json.dumps(meta))
        _reseal(step)
    allow = ["checkpoint.allow_changes=[training.optimizer.name]"] if allowed else []
    line = refused(capsys, tmp_path, "train", "--checkpoint", str(run), "training.steps=2", f"output_dir={run}",
                   "training.optimizer.name=adamw", *allow)
    assert line == (f"checkpoint.load: {step} holds the state of optimizer adamw8bit, which "
                    f"training.optimizer.name=adamw cannot resume; resume with adamw8bit, or start adamw from this "
                    f"run's weights with model.init_checkpoint={step} (a new run, no checkpoint.load)")


@pytest.mark.parametrize("forgery", ["dtype", "shape"])
def test_a_state_tensor_of_another_dtype_or_shape_is_refused(capsys, tmp_path, eight_bit_run, forgery):
    """The optimizer state's header records each tensor's dtype and shape; a tensor that is not what the optimizer
    keeps (an 8-bit code stored as float32, a block scale of another length) is one line, not cast and trained."""
    import torch
    from safetensors.torch import load_file, save_file
    from test_bad_input import _reseal

    run, step = _run_copy(tmp_path, eight_bit_run)
    tensors = load_file(step / "optim.safetensors")
    code = next(n for n, t in tensors.items() if t.dtype == torch.uint8)
    scale = next(n for n in tensors if n.startswith(code.rpartition(".")[0] + ".") and n != code
                 and tensors[n].dtype == torch.float32 and tensors[n].dim() == 1 and tensors[n].numel() > 1)
    if forgery == "dtype":
        tensors[code] = tensors[code].float()
    else:
        tensors[scale] = tensors[scale][:-1].clone()
    save_file(tensors, step / "optim.safetensors", {"format": "ipuft-checkpoint"})
    _reseal(step)
    line = refused(capsys, tmp_path, "train", "--checkpoint", str(run), "training.steps=2", f"output_dir={run}")
    if forgery == "dtype":
        assert line == (f"checkpoint {step}: optim.safetensors holds {code} as float32, optimizer adamw8bit keeps it "
                        f"as uint8: it is another optimizer's state; start from the weights with "
                        f"model.init_checkpoint={step}")
    else:
        n = tensors[scale].numel()
        assert line == f"checkpoint {step}: {scale} has shape ({n},), the model expects ({n + 1},)"


def test_adamw8bit_weights_start_adamw_through_init_checkpoint(capsys, tmp_path, eight_bit_run):
    """The way from an adamw8bit run to adamw: model.init_checkpoint takes the weights, Adam starts from zero
    moments and trains: its first step's loss is that of the checkpoint's weights on the first batch (what the
    adamw8bit run's step 1 saw, after its update), and its saved moments are float32 and Adam-sized."""
    import json

    import torch
    from safetensors.torch import load_file

    step = next((eight_bit_run / "checkpoints").glob("step-*"))
    out = tmp_path / "adamw"
    code, _, err = run_cli(capsys, "train", "--config", "tiny", f"model.init_checkpoint={step}",
                           "training.optimizer.name=adamw", "training.steps=2", "training.global_batch_size=2",
                           f"output_dir={out}")
    assert code == 0, err
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = json.loads((eight_bit_run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)
    assert losses[0] != first and abs(losses[0] - first) < 1e-2  # the updated weights, on the same first batch
    state = load_file(next((out / "checkpoints").glob("step-*")) / "optim.safetensors")
    assert {t.dtype for t in state.values()} == {torch.float32}
    assert max(t.abs().max().item() for n, t in state.items() if n.endswith(".m")) < 1.0
    assert json.loads((next((out / "checkpoints").glob("step-*")) / "meta.json").read_text())["optimizer"] == "adamw"


# -- Configs and templates through the CLI ------------------------------------------------------------------------


@pytest.mark.parametrize("base", ["/etc/hostname", "../outside", "../../../../../../etc/hostname"])
def test_a_base_outside_the_presets_and_the_directory_is_one_line(capsys, tmp_path, base):
    (tmp_path / "outside").write_text("training:\n  steps: 3\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "a.yaml").write_text(f"base: {base}\n")
    line = refused(capsys, tmp_path, "config", "show", "--config", str(tmp_path / "configs" / "a.yaml"))
    assert line.startswith(f"--config {tmp_path / 'configs' / 'a.yaml'}: base {base}: unknown preset {base!r}; "
                           f"presets: finetune, ")
    assert line.endswith(f"(or a .yaml file inside {tmp_path / 'configs'})")


def test_a_huge_format_width_in_training_is_one_line(capsys, tmp_path):
    import json

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"instruction": "name a colour", "output": "red"}) + "\n")
    line = refused(capsys, tmp_path, "train", "--config", "tiny", "data.format=instruction", f"data.path={data}",
                   "data.tokenizer=sample", "data.cache=false", "model.embedding.vocab_size=512",
                   "data.instruction_template=Q: {instruction:999999999} A: {output}", f"output_dir={tmp_path / 'run'}")
    assert line == (f"{data} row 1: data.instruction_template renders past data.template_max_chars=16,777,216: its "
                    f"format spec '999999999' asks for 999999999 characters; shorten the template or raise "
                    f"data.template_max_chars")
