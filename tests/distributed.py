"""Run a function on N Gloo ranks on this machine, as torchrun would lay them out (tests only)."""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, target, args, errors: Path) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        target(rank, *args)
    except BaseException:
        (errors / f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
    else:
        if dist.is_initialized():
            dist.barrier()  # every rank is done with its collectives before any closes its connections
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(world: int, target, *args, tmp: Path) -> None:
    """Run ``target(rank, *args)`` on ``world`` processes; raise with the first rank's traceback.

    The rendezvous port is free when chosen but may be taken by a parallel test before rank 0 binds it: a
    launch that fails for that reason alone is retried on another port."""
    errors = tmp / "errors"
    for attempt in range(3):
        errors.mkdir(exist_ok=True)
        for stale in errors.glob("rank*.txt"):
            stale.unlink()
        try:
            mp.start_processes(_entry, args=(world, free_port(), target, args, errors), nprocs=world,
                               start_method="spawn", join=True)
            return
        except Exception as exc:  # noqa: BLE001 (any failure: show the failing rank's own report)
            reports = sorted(errors.glob("rank*.txt"))
            text = reports[0].read_text() if reports else str(exc)
            if attempt < 2 and "address already in use" in text.lower():
                continue
            raise AssertionError(text) from None
