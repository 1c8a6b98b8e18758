"""Run the ``ipuft`` command line in process, as the console script would."""

import pytest

from ipuft.cli.main import main


def run_cli(capsys, *args):
    """``(exit code, stdout, stderr)`` of ``ipuft ARGS``."""
    with pytest.raises(SystemExit) as info:
        main(list(args))
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err
