"""``gelu_new`` on the CPU (:class:`ipuft_decoder.block._CpuGeluNew`, forward) against the same float32 sigmoid
form over the whole tensor at once (its form before it ran in cache-sized chunks) and ATen's tanh-GELU kernel
in the tensor's dtype, at the MLP widths of the toy presets and of GPT-J-6B, in one process.

    python bench/gelu.py [--repeats 15]

The three alternate, in turn in forward and reversed order; each figure is the median, and the ratios
are against the whole-tensor form. The results of the first two are equal bit for bit
(tests/test_components.py). Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ipuft_decoder.block import _CpuGeluNew, _sigmoid_form

SHAPES = [(512, 1024), (256, 16384), (1024, 16384)]  # a toy MLP's activations; GPT-J-6B's at 256 and 1024 tokens


class _Whole(torch.autograd.Function):
    """The sigmoid form over the whole tensor at once, in float32 rounded once, as an autograd function like the
    one it is set against."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _sigmoid_form(x.float()).to(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d')}: CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads; gelu_new forward, median ms")
    kinds = {"chunked": _CpuGeluNew.apply, "whole": _Whole.apply, "aten": lambda x: F.gelu(x, approximate="tanh")}
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            x = torch.randn(*shape).to(dtype)
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for repeat in range(args.repeats):
                for name, fn in list(kinds.items())[:: 1 if repeat % 2 else -1]:  # alternating the order
                    start = time.perf_counter()
                    fn(x)
                    times[name].append(time.perf_counter() - start)
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"  {str(dtype).removeprefix('torch.'):>8} {list(shape)!s:>14}: in chunks {ms['chunked']:7.2f}"
                  f" ({ms['whole'] / ms['chunked']:.2f}x), whole tensor {ms['whole']:7.2f}, ATen {ms['aten']:7.2f}"
                  f" ({ms['whole'] / ms['aten']:.2f}x)")


if __name__ == "__main__":
    main()
