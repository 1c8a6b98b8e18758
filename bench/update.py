"""The optimizer update's speed on the CPU, in one process (``--device cuda``: on a GPU).

Default (issue #44): one update of a [4096, 4096] and a [4096, 16384] matrix for each recipe, ns a parameter and
GB/s, against torch's fused AdamW (``torch._fused_adamw_``, float32) run in the same rounds, with a float32
``copy_`` as the memory's speed; DeepSpeedCPUAdam and bitsandbytes' AdamW8bit where they are installed:

- ``adamw`` float32: ipuft's one-pass kernel (:mod:`ipuft.engine.fused`), 28 bytes a parameter;
- ``adamw`` with bfloat16 weights rounded stochastically, float32 moments and gradient: 24 bytes;
- ``adamw8bit``, blocks of 256, float32 weights and gradient: 16 bytes; with bfloat16 weights rounded
  stochastically and a bfloat16 gradient (the 16-bit recipe's): 10 bytes.

Each round runs every variant once in turn, each after a write over twice the largest cache (the caches
evicted); each figure is the median over the rounds, and each ratio is against torch's fused AdamW of the same shape.

    python bench/update.py [--rounds 7] [--shapes 4096x4096,4096x16384] [--threads N]
    python bench/update.py --device cuda [--rounds 7]
    python bench/update.py --embedding [--rows 50400] [--touched 512] [--repeats 3]

``--device cuda``: the same shapes on the GPU, in the engine's pieces (2^22 elements): ``adamw``'s torch ops (the
update before the compiled kernel: a chain of multi-tensor kernels, and for bfloat16 stochastic rounding's int32
passes) against the compiled one-pass update (:mod:`ipuft.engine.compiled`, one kernel a piece), float32,
bfloat16 with stochastic rounding and ``adamw8bit``, against torch's fused AdamW (CUDA's ``_fused_adamw_``) and a
``copy_``; each variant synchronised, timed by the host's clock; the first round (which compiles) not counted.

``--embedding``: the Adam update of an embedding ([50400, 4096], float32 state) in the engine's pieces, with and
without ``adamw``'s floor under ``v`` before its square root (:meth:`ipuft_optim_adam.adamw.AdamW.sqrt_floor`),
and stochastic rounding into bfloat16 on the float32 bit patterns against the float formulation it equals bit
for bit. Fine-tuning touches few of an embedding's rows in a step: the others' ``v`` is exactly 0, on which
ATen's CPU ``sqrt`` takes its slow path. Not a test: the results are equal bit for bit (tests/test_adamw.py,
tests/test_fused_update.py).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch

from ipuft.engine import fused
from ipuft.engine.cuts import update_chunk, update_groups
from ipuft.optim import StepContext
from ipuft.precision import _range_bits32, _round_by_neighbours, rounding_key, stochastic_round_
from ipuft_optim_adam.adamw import AdamW
from ipuft_optim_adamw8bit.adamw8bit import AdamW8bit


def largest_cache_bytes() -> int:
    """The CPU's largest cache (Linux's sysfs; 0 where it does not say)."""
    sizes, units = [0], {"K": 2**10, "M": 2**20, "G": 2**30}
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = f.read_text().strip()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes)


# written over before each call: twice the largest cache (this machine's L3 is 480 MiB, more than a
# [4096, 4096] update's 256 MiB, which a smaller write left partly cached for the next variant)
EVICT_BYTES = max(256 * 2**20, 2 * largest_cache_bytes())
BLOCK = 256


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


def torch_fused(w: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor) -> None:
    """torch's fused AdamW (``torch._fused_adamw_``) on one float32 variable: the bench's reference."""
    torch._fused_adamw_([w], [grad], [m], [v], [], [step], lr=1e-5, beta1=0.9, beta2=0.999, weight_decay=0.01,
                        eps=1e-8, amsgrad=False, maximize=False, grad_scale=None, found_inf=None)


def peers(shape: tuple[int, int], rounds: int) -> dict[str, tuple[float, int]]:
    """Each variant's median seconds for one update of a ``shape`` matrix, and the bytes it moves a parameter."""
    n = shape[0] * shape[1]
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(n, generator=g) * 0.02
    grad = torch.randn(n, generator=g) * 1e-3
    m, v = grad * 0.1, grad * grad
    ctx = StepContext(lr=1e-5, step=3, global_norm=1.0, grad_factor=0.5)
    adamw, eight = AdamW(0.9, 0.999, 1e-8, 0.01), AdamW8bit(0.9, 0.999, 1e-8, 0.01, BLOCK)
    hyper = adamw.scalars("h.0.mlp.weight", ctx, ctx.grad_factor)
    grad16 = grad.bfloat16()
    copies = {"w": weight.clone(), "m": m.clone(), "v": v.clone(), "half": weight.bfloat16(), "dst": torch.empty(n)}
    codes = {k: torch.zeros(n, dtype=torch.uint8) for k in ("m", "v")}
    codes |= {f"{k}_absmax": torch.zeros(-(-n // BLOCK)) for k in ("m", "v")}
    step_t = torch.tensor(3.0)

    variants = {
        "float32 copy_": (lambda: copies["dst"].copy_(weight), 8),
        "torch fused AdamW": (lambda: torch_fused(copies["w"], grad, copies["m"], copies["v"], step_t), 28),
        "ipuft adamw float32": (lambda: fused.adamw_(copies["w"], grad, copies["m"], copies["v"], hyper), 28),
        "ipuft adamw bf16 + SR": (lambda: fused.adamw_(copies["half"], grad, copies["m"], copies["v"], hyper,
                                                       (12345, 0)), 24),
        "ipuft adamw8bit": (lambda: eight.fused_step(["h.0.mlp.weight"], [copies["w"]], [grad], [codes], ctx,
                                                     [None]), 16),
        "ipuft adamw8bit bf16 + SR": (lambda: eight.fused_step(["h.0.mlp.weight"], [copies["half"]], [grad16],
                                                               [codes], ctx, [(12345, 0)]), 10),
    }
    variants |= optional_peers(n, grad)
    evict = torch.empty(EVICT_BYTES // 4)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds + 1):  # the first round warms up and is not counted
        for name, (run, _) in variants.items():
            evict.fill_(1.0)
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(t[1:]), variants[name][1]) for name, t in times.items()}


def device_peers(shape: tuple[int, int], rounds: int, device: torch.device) -> dict[str, tuple[float, int]]:
    """:func:`peers` on a GPU: each variant's median seconds (synchronised) for one update of a ``shape`` matrix
    in the engine's pieces, and the bytes it moves a parameter."""
    n = shape[0] * shape[1]
    g = torch.Generator(device).manual_seed(0)
    weight = torch.randn(n, generator=g, device=device) * 0.02
    grad = torch.randn(n, generator=g, device=device) * 1e-3
    ctx = StepContext(lr=1e-5, step=3, global_norm=1.0, grad_factor=0.5)
    adamw = AdamW(0.9, 0.999, 1e-8, 0.01)
    hyper = adamw.scalars("h.0.mlp.weight", ctx, ctx.grad_factor)
    t = {"w": weight.clone(), "m": grad * 0.1, "v": grad * grad, "half": weight.bfloat16(),
         "dst": torch.empty_like(weight)}
    step_t = torch.tensor(3.0, device=device)
    pieces = [(a, b) for group in update_groups([("w", n)], update_chunk(device)) for _, a, b in group]

    def ops(half: bool):
        for a, b in pieces:
            view = t["half"][a:b].float() if half else t["w"][a:b]
            adamw.step_unit(["h.0.mlp.weight"], [view], [grad[a:b] * ctx.grad_factor],
                            [{"m": t["m"][a:b], "v": t["v"][a:b]}], ctx)
            if half:
                stochastic_round_(t["half"][a:b], view, 12345, lambda first, count, a=a: a + first)

    def one_pass(half: bool):
        w = t["half"] if half else t["w"]
        for a, b in pieces:
            fused.adamw_(w[a:b], grad[a:b], t["m"][a:b], t["v"][a:b], hyper, (12345, a) if half else None)

    eight = AdamW8bit(0.9, 0.999, 1e-8, 0.01, BLOCK)
    codes = {k: torch.zeros(n, dtype=torch.uint8, device=device) for k in ("m", "v")}
    codes |= {f"{k}_absmax": torch.zeros(-(-n // BLOCK), device=device) for k in ("m", "v")}

    def eight_bit(one_pass: bool):
        for a, b in pieces:
            piece = {k: x[a:b] if x.numel() == n else x[a // BLOCK : -(-b // BLOCK)] for k, x in codes.items()}
            if one_pass:
                eight.fused_step(["h.0.mlp.weight"], [t["w"][a:b]], [grad[a:b]], [piece], ctx, [None])
            else:
                eight.step_unit(["h.0.mlp.weight"], [t["w"][a:b]], [grad[a:b] * ctx.grad_factor], [piece], ctx)

    variants = {
        "float32 copy_": (lambda: t["dst"].copy_(weight), 8),
        "torch fused AdamW": (lambda: torch_fused(t["w"], grad, t["m"], t["v"], step_t), 28),
        "ipuft adamw8bit, ops": (lambda: eight_bit(False), 16),
        "ipuft adamw8bit": (lambda: eight_bit(True), 16),
        "ipuft adamw float32, ops": (lambda: ops(False), 28),
        "ipuft adamw float32": (lambda: one_pass(False), 28),
        "ipuft adamw bf16 + SR, ops": (lambda: ops(True), 24),
        "ipuft adamw bf16 + SR": (lambda: one_pass(True), 24),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds + 1):  # the first round compiles and warms up, and is not counted
        for name, (run, _) in variants.items():
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            run()
            torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(x[1:]), variants[name][1]) for name, x in times.items()}


def optional_peers(n: int, grad: torch.Tensor) -> dict:
    """DeepSpeed's CPU Adam and bitsandbytes' 8-bit AdamW, where they are installed (none is required)."""
    import importlib

    def deepspeed(module, p):
        return module.DeepSpeedCPUAdam([p], lr=1e-5, weight_decay=0.01, adamw_mode=True)

    def bitsandbytes(module, p):
        return module.optim.AdamW8bit([p], lr=1e-5, weight_decay=0.01, min_8bit_size=0)

    out = {}
    for name, where, make, moved in (("DeepSpeedCPUAdam", "deepspeed.ops.adam", deepspeed, 28),
                                     ("bitsandbytes AdamW8bit", "bitsandbytes", bitsandbytes, 16)):
        try:
            module = importlib.import_module(where)
        except ImportError:
            continue
        p = torch.nn.Parameter(torch.randn(n) * 0.02)
        p.grad = grad.clone()
        out[name] = (make(module, p).step, moved)
    return out


def embedding(args) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embedding", action="store_true", help="the embedding's update and rounding (see above)")
    parser.add_argument("--rows", type=int, default=50400)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--touched", type=int, default=512, help="rows with a gradient in each step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", default="4096x4096,4096x16384")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.embedding:
        embedding(args)
        return
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench/update.py: --device cuda needs a CUDA device; none is available")
        device = torch.device("cuda")
        print(f"{time.strftime('%Y-%m-%d')}: {torch.cuda.get_device_name(device)}, torch {torch.__version__}; median "
              f"of {args.rounds} rounds, in pieces of {update_chunk(device)} elements")
        report(args, lambda shape: device_peers(shape, args.rounds, device))
        return
    if fused.library() is None:
        raise SystemExit("bench/update.py: ipuft's one-pass kernel is not built on this machine (no C compiler?)")
    print(f"{time.strftime('%Y-%m-%d')}: CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; median of {args.rounds} rounds")
    report(args, lambda shape: peers(shape, args.rounds))


def report(args, measure) -> None:
    for shape in (tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")):
        n = shape[0] * shape[1]
        results = measure(shape)
        reference = results["torch fused AdamW"][0]
        print(f"[{shape[0]}, {shape[1]}]:")
        for name, (seconds, moved) in results.items():
            print(f"  {name:26s} {seconds / n * 1e9:6.2f} ns/param  {moved * n / seconds / 1e9:6.1f} GB/s  "
                  f"{seconds / reference:5.2f}x torch fused AdamW")


if __name__ == "__main__":
    main()
