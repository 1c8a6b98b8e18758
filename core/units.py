"""How ipuft writes sizes and operation counts for people: the plan, the recipe line and the errors."""

from __future__ import annotations


def format_bytes(n: int) -> str:
    """``n`` bytes in GiB, or MiB under 64 MiB."""
    return f"{n / 2**30:,.3f} GiB" if n >= 2**26 else f"{n / 2**20:,.3f} MiB"


def format_flops(n: float) -> str:
    """``n`` floating-point operations (or, with a unit appended by the caller, per second) in G or T."""
    return f"{n / 1e12:,.3f} T" if n >= 1e12 else f"{n / 1e9:,.3f} G"
