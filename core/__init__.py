"""ipuft: fine-tune GPT-J-family models larger than the accelerator's memory.

The core holds contracts (hooks, components, sharding, the step program, optimizers) and the generic
machinery that runs them. Model code lives in plugins, discovered through the ``ipuft`` entry-point group.
"""

from importlib.metadata import PackageNotFoundError, version

from ipuft.hookspecs import hookimpl

try:
    __version__ = version("ipuft")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["__version__", "hookimpl"]
