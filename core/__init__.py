"""ipuft: fine-tune causal language models (GPT-J, Llama, Mistral, Qwen2) larger than the accelerator's memory.

The core holds contracts (hooks, components, sharding, the step program, optimizers, model families) and the
generic machinery that runs them. Model code lives in plugins, discovered through the ``ipuft`` entry-point
group.

``hookimpl`` and ``__version__`` are looked up when first used: importing the package itself costs nothing, so
that the console script installs its Ctrl-C handling within milliseconds of starting (``python -m
ipuft.cli.main`` imports this package first).
"""

from typing import Any

__all__ = ["__version__", "hookimpl"]


def __getattr__(name: str) -> Any:
    if name == "hookimpl":
        from ipuft.hookspecs import hookimpl

        return hookimpl
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("ipuft")
        except PackageNotFoundError:  # running from a source tree that is not installed
            found = "0+unknown"
        globals()["__version__"] = found
        return found
    raise AttributeError(f"module 'ipuft' has no attribute {name!r}")
