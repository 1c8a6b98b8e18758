"""Run the ``ipuft`` command line in process, as the console script would."""

import re

import pytest

from ipuft.cli.main import main


def run_cli(capsys, *args):
    """``(exit code, stdout, stderr)`` of ``ipuft ARGS``."""
    with pytest.raises(SystemExit) as info:
        main(list(args))
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


def without_recipe(err: str) -> str:
    """``err`` without the lines a checkpoint given without --config starts with (its fine-tuning recipe, said once
    its config is read, before anything can fail, and the layout its plan chose)."""
    err = re.sub(r"\Aipuft: recipe finetune, as model\.(hf|init)_checkpoint is given without --config: [^\n]*\n",
                 "", err)
    # A 16-bit run on a CPU without native 16-bit kernels is warned about first (AVX2 machines): the machine's.
    err = re.sub(r"\Aipuft: warning: model\.precision=\w+: this CPU [^\n]*\n", "", err)
    # Then the layout the recipe's execution.recompute/offload=auto took (ipuft.run.layout), by this machine's memory.
    return re.sub(r"\Aipuft: execution\.(recompute|offload)=[^\n]* \(auto: [^\n]*\n", "", err)
