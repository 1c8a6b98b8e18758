"""Shared fixtures: the real plugin manager (entry points of the installed plugins), tiny configs, and
fake distributions on ``sys.path`` for testing entry-point discovery without installing anything."""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import pytest
import torch

from ipuft.config import load_config
from ipuft.plugins import create_plugin_manager
from ipuft.testing import PluginInstaller

FIXTURES = Path(__file__).parent / "fixtures"

# Share the cores among pytest-xdist's workers: oversubscribed OpenMP threads spin and slow every test.
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


# The suite tests core and the six shipped plugins. Plugins installed beside them (the examples, which .ci/run
# installs after this suite; a developer's own) are hidden from it, so that its exact expectations hold in
# any environment: filtered out of the entry points in process, and disabled by name in the processes a test
# starts (a test that sets IPUFT_DISABLE_PLUGINS for a process it starts adds to that list).
SHIPPED = {"ipuft-embeddings", "ipuft-decoder", "ipuft-lm-head", "ipuft-optim-adam", "ipuft-optim-adamw8bit",
           "ipuft-llama", "ipuft-lora"}


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


INSTALLED_BESIDE = sorted({ep.dist.metadata["Name"] for ep in metadata.entry_points(group="ipuft")
                           if ep.dist is not None and _canonical(ep.dist.metadata["Name"]) not in SHIPPED})


@pytest.fixture(autouse=True, scope="module")
def _only_shipped_plugins():
    """Before the other fixtures of each module here (a module-scoped one may build a plugin manager), and only
    for the modules here: tests run in the same session from elsewhere (the examples') see every plugin."""
    if not INSTALLED_BESIDE:
        yield
        return
    entry_points = metadata.entry_points

    def shipped_and_test_plugins(**params):
        found = entry_points(**params)
        if params.get("group") != "ipuft":
            return found
        return metadata.EntryPoints(ep for ep in found if ep.dist is None
                                    or ep.dist.metadata["Name"] not in INSTALLED_BESIDE)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metadata, "entry_points", shipped_and_test_plugins)
        yield


@pytest.fixture(autouse=True)
def _no_disabled_plugins(monkeypatch):
    if INSTALLED_BESIDE:
        monkeypatch.setenv("IPUFT_DISABLE_PLUGINS", ",".join(INSTALLED_BESIDE))
    else:
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


@pytest.fixture
def fake_dist(tmp_path, monkeypatch):
    """Install fake distributions: ``fake_dist(name, entry_points, modules)`` puts a dist-info declaring
    ``entry_points`` (and the ``modules``' sources) in ``tmp_path``, on ``sys.path`` after ``tests/fixtures``
    (the machinery of ``ipuft.testing``'s ``install_plugin``)."""
    installer = PluginInstaller(tmp_path, monkeypatch)
    installer.add_path(FIXTURES)
    return installer.distribution


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished tiny run with a checkpoint (``run/``), and a tiny Hugging Face directory (``hf/``)."""
    from hf_reference import hf_gptj

    from ipuft.run.train import train

    root = tmp_path_factory.mktemp("corpus")
    hooks = create_plugin_manager()
    train(load_config("tiny", ["training.steps=1", "training.global_batch_size=2", f"output_dir={root}/run"],
                      hooks.registrations.config_sections), hooks, progress=False)
    hf_gptj(load_config("tiny", [])).save_pretrained(root / "hf")
    return root
