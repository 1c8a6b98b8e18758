"""Shared fixtures: the real plugin manager (entry points of the installed plugins), tiny configs, and
fake distributions on ``sys.path`` for testing entry-point discovery without installing anything."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ipuft.config import load_config
from ipuft.plugins import create_plugin_manager

FIXTURES = Path(__file__).parent / "fixtures"

# Share the cores among pytest-xdist's workers: oversubscribed OpenMP threads spin and slow every test.
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


@pytest.fixture(autouse=True)
def _no_disabled_plugins(monkeypatch):
    monkeypatch.delenv("IPUFT_DISABLE_PLUGINS", raising=False)


@pytest.fixture(scope="session")
def _token_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("token-cache")


@pytest.fixture(autouse=True)
def _cache_in_tmp(monkeypatch, _token_cache):
    """The tokenized-data cache of every test (and of the processes it starts) lives in a temporary folder."""
    monkeypatch.setenv("IPUFT_CACHE_DIR", str(_token_cache))


@pytest.fixture
def hooks():
    return create_plugin_manager()


@pytest.fixture
def make_config(hooks):
    def make(*overrides: str, preset: str = "tiny"):
        return load_config(preset, list(overrides), hooks.registrations.config_sections)

    return make


def write_distribution(root: Path, name: str, entry_points: dict[str, str], version: str = "0.1.0") -> None:
    """A ``*.dist-info`` on ``root`` declaring ``entry_points`` (name → module) in the ``ipuft`` group."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "\n".join(f"{ep} = {module}" for ep, module in entry_points.items())
    (info / "entry_points.txt").write_text(f"[ipuft]\n{lines}\n")


@pytest.fixture
def fake_dist(tmp_path, monkeypatch):
    """Install fake distributions by putting their dist-info (and ``tests/fixtures``) on ``sys.path``."""
    monkeypatch.syspath_prepend(str(FIXTURES))
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(name: str, entry_points: dict[str, str], modules: dict[str, str] | None = None) -> None:
        write_distribution(tmp_path, name, entry_points)
        for module, source in (modules or {}).items():
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        for module in list(sys.modules):
            if module in (modules or {}):
                del sys.modules[module]

    return install


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished tiny run with a checkpoint (``run/``), and a tiny Hugging Face directory (``hf/``)."""
    from hf_reference import hf_gptj

    from ipuft.train import train

    root = tmp_path_factory.mktemp("corpus")
    hooks = create_plugin_manager()
    train(load_config("tiny", ["training.steps=1", "training.global_batch_size=2", f"output_dir={root}/run"],
                      hooks.registrations.config_sections), hooks, progress=False)
    hf_gptj(load_config("tiny", [])).save_pretrained(root / "hf")
    return root
