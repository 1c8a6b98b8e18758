"""Training at GPT-J-6B's width (hidden 4096, 16 heads, rotary 64, vocabulary 50400), one and two layers, on
this machine's CPU: what toy widths hide.

    python bench/width.py [KEY=VALUE ...] [--layers 1 2] [--seq 256 128] [--micro-batch 1 4] [--steps 3] \
        [--precision ...]   # KEY=VALUE first, e.g. model.tie_embeddings=true: the head uses the embedding table

Each configuration (gradient accumulation 2) runs as ``ipuft bench --profile`` in a process of its own (its
peak RSS and page faults are that process's), after ``ipuft plan`` of the same config, and prints:

- the step time, and model FLOP/s against the matmul peak measured in the same run (a ``[tokens, 4096] ×
  [4096, 16384]`` matmul in the run's dtype): MFU, and with the recompute HFU;
- a decoder layer's rate: its forward, recompute and backward FLOPs over its forward and backward phases'
  time (the issue's target: at least 50% of the matmul's), against the same peak, and against the same
  matmul's rate over half a second before each profiled step and after the last (``ipuft bench --profile``'s
  ``matmul_rate``). This machine's bfloat16 matmul switches between two speeds about 2x apart from one
  second to the next (from outside the process: other guests on the host, it seems; float32 varies less),
  so a best-of peak is the fast speed while a layer's phases, seconds long, run at a mix of both: the
  interleaved rate is the like-for-like figure, the peak the conservative one;
- peak RSS against the plan's ``host_needed_bytes`` (it must stay under, and above 80% of it);
- the per-phase breakdown.

Besides float32, it runs the 16-bit dtypes this CPU multiplies fast (``ipuft.kernels``' probe: at least half
the float32 rate), with stochastic rounding, the reference's recipe; ``--precision`` picks them instead.
Not a test: the machines are noisy, so read the ratios, which come from one run each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from ipuft import kernels

WIDTH = ["--config", "tiny", "model.hidden_size=4096", "model.attention.heads=16", "model.attention.rotary_dim=64",
         "model.embedding.vocab_size=50400", "execution.device=cpu", "checkpoint.save=null"]
SIXTEEN_BIT = {"bfloat16": ["training.stochastic_rounding=true"],
               "float16": ["training.stochastic_rounding=true", "execution.loss_scaling=dynamic"]}


def fast_dtypes() -> list[str]:
    """float32, and the 16-bit dtypes this CPU multiplies at least half as fast (the kernels' probe)."""
    rates = kernels.measured_rates((torch.float32, torch.bfloat16, torch.float16))
    return ["float32", *(d for d in SIXTEEN_BIT if rates[d] >= kernels.SLOW * rates["float32"])]


def ipuft(args: list[str], env: dict) -> tuple[dict, dict]:
    """Run ``ipuft ARGS --json`` in a process of its own: its JSON, and its resource usage (peak RSS in
    bytes, minor and major page faults, seconds)."""
    began = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        child = subprocess.Popen(["ipuft", *args, "--json"], stdout=out, stderr=subprocess.PIPE, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        err = child.stderr.read().decode(errors="replace")
        child.stderr.close()
        if status:
            sys.exit(f"ipuft {' '.join(args)} failed:\n{err}")
        out.seek(0)
        result = json.loads(out.read())
    return result, {"max_rss_bytes": usage.ru_maxrss * 1024, "minor_faults": usage.ru_minflt,
                    "major_faults": usage.ru_majflt, "seconds": time.perf_counter() - began}


def run(layers: int, seq: int, micro_batch: int, precision: str, steps: int, env: dict,
        overrides: tuple[str, ...] = ()) -> dict:
    """One configuration: gradient accumulation 2 of ``micro_batch`` rows of ``seq`` tokens, with ``overrides``."""
    config = [*WIDTH, f"model.layers={layers}", f"model.sequence_length={seq}", f"model.precision={precision}",
              f"execution.micro_batch_size={micro_batch}", f"training.global_batch_size={2 * micro_batch}",
              *SIXTEEN_BIT.get(precision, []), *overrides]
    plan, _ = ipuft(["plan", *config], env)
    bench, usage = ipuft(["bench", *config, "--profile", "--steps", str(steps)], env)
    profile, peak = bench["profile"], bench["matmul_peak"]["flops_per_s"]
    between = profile["matmul_rate"]
    decoder = {kind: plan["flops_per_step"]["by_phase"]["decoder"][kind] for kind in ("forward", "backward")}
    layer_flops = sum(f["model"] + f["recompute"] for f in decoder.values())
    layer_seconds = profile["phases"]["decoder"]["forward"] + profile["phases"]["decoder"]["backward"]
    return {"layers": layers, "seq": seq, "micro_batch": micro_batch, "precision": precision,
            "step_s": bench["duration_s"],
            "tokens_per_s": bench["tokens_per_s"], "model_flops_per_s": bench["model_flops_per_s"],
            "mfu": bench["mfu"], "hfu": bench["hfu"], "peak_flops_per_s": peak, "matmul": bench["matmul_peak"],
            "layer_flops_per_s": layer_flops / layer_seconds, "layer_of_peak": layer_flops / layer_seconds / peak,
            "matmul_rate": between, "layer_of_matmul_rate": layer_flops / layer_seconds / between["flops_per_s"],
            "host_needed_bytes": plan["machine"]["host_needed_bytes"], **usage,
            "rss_of_plan": usage["max_rss_bytes"] / plan["machine"]["host_needed_bytes"],
            "parameters": plan["parameters"], "profile": profile}


def report(r: dict) -> str:
    gib, giga = 2**30, 1e9
    lines = [
        f"== {r['layers']} layer{'s' * (r['layers'] > 1)}, seq {r['seq']}, micro-batch {r['micro_batch']} (GA 2), "
        f"{r['precision']}: {r['parameters']:,} parameters",
        f"   step {r['step_s']:.2f} s ({r['tokens_per_s']:.1f} tokens/s); model {r['model_flops_per_s'] / giga:,.1f} "
        f"GFLOP/s: MFU {r['mfu']:.1%}, HFU {r['hfu']:.1%} of the {' × '.join(map(str, r['matmul']['shape']))} "
        f"matmul's {r['peak_flops_per_s'] / giga:,.1f} GFLOP/s",
        f"   a decoder layer (forward, recompute, backward): {r['layer_flops_per_s'] / giga:,.1f} GFLOP/s = "
        f"{r['layer_of_peak']:.1%} of the matmul peak; {r['layer_of_matmul_rate']:.1%} of the matmul's "
        f"{r['matmul_rate']['flops_per_s'] / giga:,.1f} GFLOP/s between the profiled steps (each half second's: "
        + ", ".join(f"{x / giga:,.0f}" for x in r["matmul_rate"]["samples"]) + ")",
        f"   peak RSS {r['max_rss_bytes'] / gib:.2f} GiB = {r['rss_of_plan']:.1%} of the plan's "
        f"{r['host_needed_bytes'] / gib:.2f} GiB; page faults {r['minor_faults']:,} minor, {r['major_faults']:,} major",
    ]
    for role, kind in r["profile"]["phase_order"]:
        rate = r["profile"]["phase_flops"][role][kind]["flops_per_s"]
        rate_text = f"  {rate / giga:9,.1f} GFLOP/s" if rate else ""
        lines.append(f"     {role + ':' + kind:<22} {r['profile']['phases'][role][kind]:8.3f} s{rate_text}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 128])
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[1], help="rows per micro-batch (GA is 2)")
    parser.add_argument("--steps", type=int, default=3, help="timed (and profiled) steps of each run")
    parser.add_argument("--precision", nargs="+", default=None, help="default: float32 and the fast 16-bit dtypes")
    parser.add_argument("--no-huge-pages", action="store_true", help="THP_MEM_ALLOC_ENABLE=0 (ipuft.hostmem)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE settings for every run")
    args = parser.parse_args()
    env = dict(os.environ, **({"THP_MEM_ALLOC_ENABLE": "0"} if args.no_huge_pages else {}))
    precisions = args.precision or fast_dtypes()
    print(f"{time.strftime('%Y-%m-%d')}: CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; 16-bit rates from ipuft.kernels: "
          + ", ".join(f"{d} {r / 1e9:,.0f} GFLOP/s" for d, r in
                      kernels.measured_rates((torch.float32, torch.bfloat16, torch.float16)).items()), flush=True)
    results = []
    for precision in precisions:
        for layers in args.layers:
            for seq in args.seq:
                for micro_batch in args.micro_batch:
                    results.append(run(layers, seq, micro_batch, precision, args.steps, env, tuple(args.overrides)))
                    print(json.dumps(results[-1]) if args.json else report(results[-1]), flush=True)


if __name__ == "__main__":
    main()
