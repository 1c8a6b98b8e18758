"""The optimizer step's elementwise work at GPT-J-6B's width on the CPU, in the engine's pieces
(``ipuft.engine.update``), in one process:

- the Adam update of an embedding ([50400, 4096], float32 state), with and without ``adamw``'s floor under ``v``
  before its square root (:meth:`ipuft_optim_adam.adamw.AdamW.sqrt_floor`);
- stochastic rounding of a float32 update into bfloat16 weights as many as the embedding's, on the float32 bit
  patterns (``ipuft.engine.precision``'s path) and by the float formulation it equals bit for bit.

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

from ipuft.engine.precision import _range_bits32, _round_by_neighbours, rounding_key, stochastic_round_
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


def rounding(value: torch.Tensor, weight: torch.Tensor, step: int, float_formulation: bool) -> float:
    """Stochastic rounding of ``value`` into ``weight`` in the engine's pieces; its seconds."""
    key, chunk = rounding_key(0, "embeddings", "wte.weight", step), update_chunk("cpu")
    flat_v, flat_w = value.view(-1), weight.view(-1)
    start_time = time.perf_counter()
    for start in range(0, flat_w.numel(), chunk):
        piece_v, piece_w = flat_v[start : start + chunk], flat_w[start : start + chunk]
        if float_formulation:
            piece_w.copy_(_round_by_neighbours(piece_v, weight.dtype, _range_bits32(key, start, piece_v.numel())))
        else:
            stochastic_round_(piece_w, piece_v, key, lambda first, count, start=start: start + first)
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
    del m, v, grad
    half = weight.bfloat16()
    times = {"bits": [], "float": []}
    for step in range(1, args.repeats + 1):
        for name in times:
            times[name].append(rounding(weight, half, step, name == "float"))
    b, f = statistics.median(times["bits"]), statistics.median(times["float"])
    print(f"  stochastic rounding into bfloat16: by the float formulation {f:.3f} s ({f / n * 1e9:.2f} ns a weight); "
          f"on the bit patterns {b:.3f} s ({b / n * 1e9:.2f} ns): {f / b:.2f}x")


if __name__ == "__main__":
    main()
