"""The CUDA path on one GPU, in one command of at most 10 minutes: ``tests/test_cuda.py``, then at GPT-J-6B's and
Llama-3-8B's width (a few layers, bfloat16 with stochastic rounding, sequence 2048, GA 8 and 32) a resident step
(``execution.offload=false``) and an offloaded one (the preset's layout: weights, state and activations in host
memory), each in a process of its own.

    python bench/gpu.py [--out gpu.json] [--layers 2] [--ga 8 32] [--steps 2] [--no-tests]
    python bench/gpu.py --dry-run          # the same program on this CPU, at toy width, in a minute

For each run it prints tokens/s, MFU against a bfloat16 matmul peak measured in the same process, the
offloaded / resident ratio, ``torch.cuda.max_memory_allocated`` against the plan's device peak, the host→device
bandwidth the step reached against a pinned copy's measured in the same process, and how much of the copy time
the prefetch hid: one minus the copies' visible time (:mod:`ipuft.profiling`'s ``copies``) over the time
the step's host→device bytes take at the measured bandwidth. The figures are written as JSON (``--out``).
Not a test: it measures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

WIDTHS = {  # the preset, and the name of the width it stands for
    "gptj-6b": "GPT-J-6B width (hidden 4096, vocabulary 50400)",
    "llama3-8b": "Llama-3-8B width (hidden 4096, vocabulary 128256)",
}
RECIPE = ["model.precision=bfloat16", "training.stochastic_rounding=true", "model.sequence_length=2048",
          "execution.micro_batch_size=1", "checkpoint.save=null", "execution.device=auto"]
# --dry-run: the same program at a width a CPU runs in seconds.
DRY = ["model.hidden_size=256", "model.attention.heads=4", "model.intermediate_size=512", "model.sequence_length=128",
       "model.embedding.vocab_size=2048", "execution.device=cpu"]
DRY_ROTARY = {"gptj-6b": ["model.attention.rotary_dim=16"],
              # Llama 3's special-token ids (128000, 128001) lie past the toy vocabulary: ids inside it.
              "llama3-8b": ["model.attention.rotary_dim=64", "plugins.llama.kv_heads=2", "model.bos_token_id=1",
                            "model.eos_token_ids=[2]"]}
LAYOUTS = {"resident": ["execution.offload=false", "execution.activation_offload=false"],
           "offloaded": ["execution.offload=true"]}


def pinned_bandwidth(device) -> float | None:
    """Host→device bytes/s of a 256 MiB copy from pinned memory (the best of three); None on a CPU."""
    import torch

    if device.type != "cuda":
        return None
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(host, device=device)
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        best = max(best, host.numel() / (time.perf_counter() - start))
    return best


def child(preset: str, overrides: list[str], steps: int) -> dict:
    """One run, in this process: the plan, then ``ipuft bench --profile``'s figures, with the CUDA allocator's
    peak over the benchmark and the pinned copy bandwidth."""
    import torch

    from ipuft.config import load_config
    from ipuft.engine.model import build_model
    from ipuft.plan.estimate import estimate
    from ipuft.plugins import create_plugin_manager
    from ipuft.run.bench import benchmark

    hooks = create_plugin_manager()
    cfg = load_config(preset, overrides, hooks.registrations.config_sections)
    plan = estimate(cfg, build_model(cfg, hooks, hooks.registrations.build_optimizer(cfg)), hooks)
    cuda = torch.cuda.is_available() and cfg.execution.device.value != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    bandwidth = pinned_bandwidth(device)
    if cuda:
        torch.cuda.reset_peak_stats(device)
    result = benchmark(cfg, hooks, timed_steps=steps, profile=True)
    allocated = torch.cuda.max_memory_allocated(device) if cuda else None
    copies = result["profile"]["seconds"].get("copies", 0.0)  # per step: the copies' time the step waited for
    exposed = None
    if bandwidth and copies is not None and result["h2d_bytes"]:
        exposed = copies / (result["h2d_bytes"] / bandwidth)
    return {"tokens_per_s": result["tokens_per_s"], "step_s": result["duration_s"], "mfu": result.get("mfu"),
            "hfu": result.get("hfu"), "matmul_peak_flops_per_s": result["matmul_peak"]["flops_per_s"],
            "max_memory_allocated": allocated, "plan_device_peak_bytes": plan["device_peak_bytes"],
            "ledger_device_peak_bytes": result["device_peak_bytes"], "h2d_bytes": result["h2d_bytes"],
            "h2d_bytes_per_s": result["h2d_bytes"] / result["duration_s"], "pinned_bytes_per_s": bandwidth,
            "copies_visible_s": copies, "prefetch_hidden": None if exposed is None else max(0.0, 1.0 - exposed),
            "device": str(device), "parameters": plan["parameters"]}


def run_child(preset: str, overrides: list[str], steps: int, timeout: float) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        args = [sys.executable, __file__, "--child", preset, "--child-out", out.name, "--steps", str(steps), *overrides]
        done = subprocess.run(args, check=False, capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"error": " | ".join(tail)[:400]}
        return json.loads(open(out.name).read())


def report(width: str, ga: int, layout: str, r: dict) -> str:
    if "error" in r:
        return f"{width} GA {ga} {layout}: failed: {r['error']}"
    gib = 2**30
    line = (f"{width} GA {ga} {layout}: {r['tokens_per_s']:,.0f} tokens/s ({r['step_s']:.2f} s/step), MFU "
            f"{(r['mfu'] or 0):.1%} of a {r['matmul_peak_flops_per_s'] / 1e12:,.1f} TFLOP/s matmul")
    if r["max_memory_allocated"] is not None:
        line += (f"; max_memory_allocated {r['max_memory_allocated'] / gib:.2f} GiB = "
                 f"{r['max_memory_allocated'] / r['plan_device_peak_bytes']:.0%} of the plan's "
                 f"{r['plan_device_peak_bytes'] / gib:.2f} GiB")
    if r["pinned_bytes_per_s"]:
        line += f"; h2d {r['h2d_bytes_per_s'] / 1e9:.1f} GB/s of a pinned copy's {r['pinned_bytes_per_s'] / 1e9:.1f}"
    if r["prefetch_hidden"] is not None:
        line += f"; the prefetch hid {r['prefetch_hidden']:.0%} of the copy time"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on this CPU at toy width")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ga", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=2, help="timed (and as many profiled) steps per run")
    parser.add_argument("--widths", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    parser.add_argument("--no-tests", action="store_true", help="skip tests/test_cuda.py")
    parser.add_argument("--out", default="gpu.json")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole command")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        with open(args.child_out, "w") as f:
            json.dump(child(args.child, args.overrides, args.steps), f)
        return
    began = time.perf_counter()
    figures: dict = {"date": time.strftime("%Y-%m-%d"), "dry_run": args.dry_run, "runs": []}
    if not args.no_tests:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n0", "tests/test_cuda.py"], check=False,
                               capture_output=True, text=True, cwd=root)
        summary = (tests.stdout.strip().splitlines() or ["(no output)"])[-1]
        figures["test_cuda"] = {"returncode": tests.returncode, "summary": summary}
        print(f"tests/test_cuda.py: {summary}", flush=True)
    for width in args.widths:
        for ga in args.ga:
            ratio = {}
            for layout, keys in LAYOUTS.items():
                left = args.budget - (time.perf_counter() - began)
                if left < 30:
                    print(f"{width} GA {ga} {layout}: skipped, the budget is spent", flush=True)
                    continue
                overrides = [f"model.layers={args.layers}", f"training.global_batch_size={ga}", *RECIPE, *keys]
                if args.dry_run:
                    overrides += [*DRY, *DRY_ROTARY[width]]
                r = run_child(width, overrides, args.steps, timeout=left)
                figures["runs"].append({"width": width, "ga": ga, "layout": layout, **r})
                print(report(WIDTHS[width] if not args.dry_run else f"{width} (dry run)", ga, layout, r), flush=True)
                ratio[layout] = r.get("tokens_per_s")
            if ratio.get("resident") and ratio.get("offloaded"):
                print(f"   offloaded / resident: {ratio['offloaded'] / ratio['resident']:.2f}x", flush=True)
    with open(args.out, "w") as f:
        json.dump(figures, f, indent=1)
    print(f"wrote {args.out} ({time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
