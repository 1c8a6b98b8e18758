"""``adamw8bit`` against ``adamw`` on the CPU, in one process:

- ``update``: the optimizer step of one ``[4096, 4096]`` float32 variable in the engine's pieces
  (``ipuft.engine.update``): seconds, nanoseconds per parameter and the ratio to ``adamw``'s;
- ``loss``: a fine-tune of the ``tiny`` model on the shipped MNLI sample (real text, the sample tokenizer)
  with each optimizer from the same seeds: the mean loss of the last 10 steps, and their relative difference
  (exit status 1 above 2%).

    python bench/adamw8bit.py update [--rows 4096] [--hidden 4096] [--repeats 5]
    python bench/adamw8bit.py loss [--steps 150]

Not tests: ``tests/test_adamw8bit.py`` shows the update equal to a plain reference bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ipuft.components import VariableSpec
from ipuft.engine.cuts import update_chunk, update_groups
from ipuft.hostmem import retain_freed_memory
from ipuft.optim import Optimizer, StepContext, state_piece
from ipuft_optim_adam.adamw import AdamW
from ipuft_optim_adamw8bit.adamw8bit import AdamW8bit


def update(opt: Optimizer, weight: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
           step: int) -> float:
    """One update of the whole variable in the engine's pieces (as ``UnitUpdate`` cuts them); its seconds."""
    ctx = StepContext(lr=1e-5, step=step, global_norm=1.0, grad_factor=1.0)
    w, g = weight.view(-1), grad.view(-1)
    start_time = time.perf_counter()
    for group in update_groups([("layer.weight", weight.numel())], update_chunk("cpu"), opt.block_size):
        for name, start, stop in group:
            piece = {k: state_piece(opt, k, t, start, stop) for k, t in state.items()}
            opt.step_unit([name], [w[start:stop]], [g[start:stop].clone()], [piece], ctx)
    return time.perf_counter() - start_time


def bench_update(args: argparse.Namespace) -> None:
    retain_freed_memory(args.hidden)  # as the engine does (execution.retain_host_memory): temporaries reused
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(args.rows, args.hidden, generator=g) * 0.02
    grad = torch.randn(args.rows, args.hidden, generator=g) * 1e-3
    spec = VariableSpec("layer.weight", tuple(weight.shape))
    optimizers = {"adamw": AdamW(0.9, 0.999, 1e-6, 0.01), "adamw8bit": AdamW8bit(0.9, 0.999, 1e-6, 0.01, 256)}
    states = {name: {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in opt.state_specs(spec)}
              for name, opt in optimizers.items()}
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for step in range(1, args.repeats + 2):
        for name, opt in optimizers.items():
            seconds = update(opt, weight.clone(), grad, states[name], step)
            if step > 1:  # the first from zero state: every block's absmax is then new
                times[name].append(seconds)
    base, mine = (min(times[n]) for n in optimizers)  # the machine is shared: the fastest run is the work's own
    n = weight.numel()
    print(f"{time.strftime('%Y-%m-%d')}: CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, [{args.rows}, {args.hidden}] float32, fastest of {args.repeats}")
    print(f"adamw     {base:.3f} s  {base / n * 1e9:.2f} ns/parameter")
    print(f"adamw8bit {mine:.3f} s  {mine / n * 1e9:.2f} ns/parameter  ({mine / base:.2f}x adamw's)")


def bench_loss(args: argparse.Namespace) -> None:
    from ipuft.config import load_config
    from ipuft.data.tokens import data_source
    from ipuft.plugins import create_plugin_manager
    from ipuft.run.runtime import build_engine
    from ipuft.run.schedule import learning_rate
    from ipuft.run.train import replica_batch

    hooks = create_plugin_manager()
    final = {}
    for name in ("adamw", "adamw8bit"):
        cfg = load_config("tiny", ["data.path=mnli-sample", "data.tokenizer=sample", "model.embedding.vocab_size=512",
                                   "model.sequence_length=32", "training.global_batch_size=8",
                                   "execution.micro_batch_size=8", "training.optimizer.learning_rate.maximum=3e-3",
                                   "training.optimizer.learning_rate.warmup_proportion=0.1",
                                   f"training.optimizer.name={name}", f"training.steps={args.steps}"],
                          hooks.registrations.config_sections)
        engine, data = build_engine(cfg, hooks), data_source(cfg)
        schedule = cfg.training.optimizer.learning_rate
        losses = [engine.step(replica_batch(cfg, data, s, engine.layout), learning_rate(s, args.steps, schedule)).loss
                  for s in range(args.steps)]
        final[name] = statistics.fmean(losses[-10:])
        print(f"{name:9} first loss {losses[0]:.4f}, mean of the last 10 of {args.steps} steps {final[name]:.4f}")
    rel = abs(final["adamw8bit"] - final["adamw"]) / final["adamw"]
    print(f"{time.strftime('%Y-%m-%d')}: adamw8bit's final loss is {100 * rel:.2f}% from adamw's")
    sys.exit(0 if rel <= 0.02 else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    up = sub.add_parser("update", help="update time per parameter against adamw's")
    up.add_argument("--rows", type=int, default=4096)
    up.add_argument("--hidden", type=int, default=4096)
    up.add_argument("--repeats", type=int, default=5)
    loss = sub.add_parser("loss", help="final loss of a short fine-tune against adamw's")
    loss.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    (bench_update if args.what == "update" else bench_loss)(args)


if __name__ == "__main__":
    main()
