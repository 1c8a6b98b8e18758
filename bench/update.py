"""The Adam update of a GPT-J-6B-wide embedding ([50400, 4096], float32 state) as the engine runs it on the CPU
(``ipuft.engine.update``'s pieces), with and without ``adamw``'s floor under ``v`` before its square root
(:meth:`ipuft_optim_adam.adamw.AdamW.sqrt_floor`), in one process.

    python bench/update.py [--rows 50400] [--touched 512] [--repeats 3]

Fine-tuning touches few of an embedding's rows in a step: the others' ``v`` is exactly 0, on which ATen's CPU
``sqrt`` takes its slow path. ``--touched`` rows get a gradient (a step's distinct tokens), after one update of
every row's state from zero. The two variants alternate, and each figure is the median; the ratio is what the
floor saves. Not a test: the results are equal bit for bit (tests/test_adamw.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ipuft.engine.update import update_chunk, update_groups
from ipuft.optim import StepContext
from ipuft_optim_adam.adamw import AdamW


def update(opt: AdamW, weight: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
           step: int) -> float:
    """One update of the whole variable in the engine's pieces; its seconds."""
    ctx = StepContext(lr=1e-5, step=step, global_norm=1.0, grad_factor=1.0)
    flat = [t.view(-1) for t in (weight, grad, m, v)]
    start_time = time.perf_counter()
    for group in update_groups([("wte.weight", weight.numel())], update_chunk("cpu")):
        for name, start, stop in group:
            w, g, mm, vv = (t[start:stop] for t in flat)
            opt.step_unit([name], [w], [g.clone()], [{"m": mm, "v": vv}], ctx)
    return time.perf_counter() - start_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50400)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--touched", type=int, default=512, help="rows with a gradient in each step")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(args.rows, args.hidden, generator=g) * 0.02
    m, v = torch.zeros_like(weight), torch.zeros_like(weight)
    grad = torch.zeros_like(weight)
    touched = min(args.touched, args.rows)
    grad[torch.randperm(args.rows, generator=g)[:touched]] = torch.randn(touched, args.hidden,
                                                                             generator=g) * 1e-3
    floored, plain = AdamW(0.9, 0.999, 1e-6, 0.0), AdamW(0.9, 0.999, 1e-6, 0.0)
    plain.sqrt_floor = lambda bias2: None
    times: dict[str, list[float]] = {"floor": [], "plain": []}
    for step in range(1, args.repeats + 1):
        for name, opt in (("floor", floored), ("plain", plain)):
            times[name].append(update(opt, weight, grad, m, v, step))
    f, p = statistics.median(times["floor"]), statistics.median(times["plain"])
    n = weight.numel()
    print(f"{time.strftime('%Y-%m-%d')}: CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads; Adam update of [{args.rows}, {args.hidden}], {args.touched} rows "
          f"with a gradient")
    print(f"  without the floor {p:.3f} s ({p / n * 1e9:.2f} ns a weight); with it {f:.3f} s "
          f"({f / n * 1e9:.2f} ns): {p / f:.2f}x")


if __name__ == "__main__":
    main()
