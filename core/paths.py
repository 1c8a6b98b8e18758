"""Where ipuft keeps what it caches on this machine (tokenized datasets, the kernels' probe): imported by the
data and the engine alike, so it imports nothing of ipuft."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where tokenized datasets are cached: ``IPUFT_CACHE_DIR``, else ``$XDG_CACHE_HOME/ipuft``, else
    ``~/.cache/ipuft``."""
    if os.environ.get("IPUFT_CACHE_DIR"):
        return Path(os.environ["IPUFT_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "ipuft"
