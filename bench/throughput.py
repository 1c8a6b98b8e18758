"""Training throughput of ipuft against transformers' GPTJForCausalLM + torch.optim.AdamW +
clip_grad_norm_, on the same config, data and gradient accumulation, in one process.

    python bench/throughput.py [--steps N] [--repeats R] [KEY=VALUE ...]
    python bench/throughput.py --real smollm2-135m [--steps N] [--repeats R] [KEY=VALUE ...]

Prints tokens/s of each and the ratio ipuft / baseline in float32: without recompute (offload off), against
transformers eager; with recompute, offload off and on, against transformers with gradient checkpointing
too; and in bfloat16 (ipuft with stochastic rounding, offload on) against transformers with its parameters
in bfloat16. The runs
alternate and each figure is the median step time, since these machines are noisy. Not a test.

``--real NAME``: a real checkpoint's shapes instead (random weights saved as a Hugging Face directory with
that config, read by ``model.hf_checkpoint``, float32): the finetune recipe's default layout (``auto``), ipuft
without recompute and with recompute and offload, each against transformers' model of the checkpoint with
torch.optim.AdamW and clip_grad_norm_, without gradient checkpointing (the Trainer's default step).
``--processes``: each runner in a process of its own, as a user runs one (one untimed step, then ``--steps``
timed), the processes started in turn for each of ``--repeats`` rounds; the median over all of a runner's steps.
ipuft's processes get huge pages, as the ``ipuft`` console script sets them (:mod:`ipuft.hostmem`); the
baseline's the environment's (torch's default: none).
A process holds one model, so a 0.5B-parameter model fits where four in one process do not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from ipuft.config import load_config
from ipuft.data.synthetic import SampleData
from ipuft.hostmem import HUGE_PAGES_ENV
from ipuft.plugins import create_plugin_manager
from ipuft.run.runtime import build_engine

# A CPU-sized GPT-J: big enough that compute, not Python, dominates.
DEFAULTS = ["model.layers=4", "model.hidden_size=256", "model.attention.heads=8", "model.attention.rotary_dim=16",
            "model.sequence_length=256", "model.embedding.vocab_size=2048", "training.global_batch_size=8",
            "execution.micro_batch_size=2", "plugins.adamw.weight_decay=0.01",
            "execution.device=cpu"]  # the transformers baseline runs on the CPU too


# Real checkpoints' configs (config.json's arithmetic keys), at the bench's sequence length and batch.
REAL = {
    "smollm2-135m": {"class": "LlamaForCausalLM", "config": "LlamaConfig", "overrides": [
        "model.sequence_length=256", "training.global_batch_size=8", "execution.micro_batch_size=2"],
        "keys": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 100000.0,
                 "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "bos_token_id": 0, "eos_token_id": 0}},
    "qwen2.5-0.5b": {"class": "Qwen2ForCausalLM", "config": "Qwen2Config", "overrides": [
        "model.sequence_length=256", "training.global_batch_size=8", "execution.micro_batch_size=2"],
        "keys": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                 "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
                 "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                 "bos_token_id": 0, "eos_token_id": 0}},
}


def real_checkpoint(name: str, directory) -> object:
    """A random model with ``name``'s config saved into ``directory``; the model (float32, train mode)."""
    import transformers

    spec = REAL[name]
    config = getattr(transformers, spec["config"])(**spec["keys"])
    torch.manual_seed(0)
    model = getattr(transformers, spec["class"])(config)
    model.save_pretrained(directory, safe_serialization=True)
    return model.train()


def real_variants(args, hooks, home: str) -> tuple[dict, object]:
    """The ipuft configs of ``--real``'s runs, by name, and the layout ``auto`` chose for the default."""
    from ipuft.run.layout import choose_layout

    sections = hooks.registrations.config_sections
    base = [f"model.hf_checkpoint={home}", "model.precision=float32", "plugins.adamw.weight_decay=0.01",
            "execution.device=cpu", *REAL[args.real]["overrides"], *args.overrides]
    default, layout = choose_layout(load_config("finetune", base, sections), hooks)
    return {"default": default,
            "no_recompute": load_config("finetune", base + ["execution.offload=false", "execution.recompute=false"],
                                        sections),
            "recompute_offload": load_config("finetune", base + ["execution.offload=true", "execution.recompute=true"],
                                             sections)}, layout


def bench_batches(cfg, steps: int) -> list:
    """The bench's synthetic rows: ``steps`` batches of ``cfg``'s shapes, the same for every runner."""
    data = SampleData(cfg.model.embedding.vocab_size, cfg.model.sequence_length)
    return [data.batch(s, cfg.training.global_batch_size, cfg.execution.micro_batch_size) for s in range(steps)]


def child_main(args, hooks) -> None:
    """``--child NAME``: one runner's untimed step and ``--steps`` timed ones; prints their seconds as JSON."""
    variants, _ = real_variants(args, hooks, args.home)
    cfg = variants["no_recompute"]
    if args.child == "baseline":
        import transformers

        model = getattr(transformers, REAL[args.real]["class"]).from_pretrained(args.home, dtype=torch.float32)
        step = model_step_fn(cfg, model.train())
    else:
        step = ipuft_step_fn(variants[args.child], hooks)
    batches = bench_batches(cfg, args.steps)
    step(batches[0])
    print(json.dumps([timed(step, b) for b in batches]))


def by_processes(args, names: list[str], cfg) -> dict:
    """Tokens/s of each runner, each run in a process of its own, the processes in turn for each round."""
    import subprocess
    import sys

    seconds = {name: [] for name in names}
    ours = dict(os.environ)  # ipuft's runners as the console script runs them: huge pages (ipuft.hostmem)
    ours.setdefault(HUGE_PAGES_ENV, "1")
    for _ in range(args.repeats):
        for name in names:
            done = subprocess.run([sys.executable, __file__, "--real", args.real, "--child", name, "--home", args.home,
                                   "--steps", str(args.steps), *args.overrides], capture_output=True, text=True,
                                  check=False, env=os.environ if name == "baseline" else ours)
            if done.returncode:  # the child's own last lines say why
                raise SystemExit(f"the {name} runner failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
            seconds[name] += json.loads(done.stdout.strip().splitlines()[-1])
    tokens = cfg.training.global_batch_size * cfg.model.sequence_length
    return {name: tokens / statistics.median(v) for name, v in seconds.items()}


def real_main(args, hooks) -> None:
    import copy
    import tempfile

    with tempfile.TemporaryDirectory() as home:
        model = real_checkpoint(args.real, home)
        variants, layout = real_variants(args, hooks, home)
        cfg = variants["no_recompute"]
        if args.processes:
            del model
            args.home = home
            result = by_processes(args, ["baseline", *variants], cfg)
        else:
            runners = {"baseline": model_step_fn(cfg, copy.deepcopy(model)),
                       **{n: ipuft_step_fn(c, hooks) for n, c in variants.items()}}
            del model
            result = race(runners, bench_batches(cfg, args.steps), args.repeats, cfg)
    result.update({f"ratio_{n}": result[n] / result["baseline"] for n in variants})
    result["config"] = {"model": args.real, "seq": cfg.model.sequence_length, "gbs": cfg.training.global_batch_size,
                        "ga": cfg.gradient_accumulation, "threads": torch.get_num_threads(),
                        "cpu": torch.backends.cpu.get_cpu_capability(), "processes": args.processes,
                        "default_layout": {"recompute": layout.recompute, "offload": layout.offload}}
    if args.json:
        print(json.dumps(result))
        return
    print(f"config: {result['config']}")
    print(f"baseline (transformers {REAL[args.real]['class']} + AdamW + clip_grad_norm_): "
          f"{result['baseline']:10.1f} tokens/s")
    for n in variants:
        print(f"ipuft {n:<17}: {result[n]:10.1f} tokens/s   ratio {result[f'ratio_{n}']:.2f}x")


def race(runners: dict, batches: list, repeats: int, cfg) -> dict:
    """Tokens/s of each runner: one untimed step each, then the steps in turn, the median step time."""
    for step in runners.values():
        step(batches[0])  # one untimed step each, as the reference's main()
    seconds = {name: [] for name in runners}
    for _ in range(repeats):
        for b in batches:  # step by step in turn, so that machine noise hits every runner alike
            for name, step in runners.items():
                seconds[name].append(timed(step, b))
    tokens = cfg.training.global_batch_size * cfg.model.sequence_length
    return {name: tokens / statistics.median(v) for name, v in seconds.items()}


def hf_model(cfg, dtype=torch.float32):
    from transformers import GPTJConfig, GPTJForCausalLM

    m = cfg.model
    hf_cfg = GPTJConfig(vocab_size=m.embedding.vocab_size, n_positions=m.sequence_length, n_embd=m.hidden_size,
                        n_layer=m.layers, n_head=m.attention.heads, rotary_dim=m.attention.rotary_dim,
                        n_inner=m.intermediate_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return GPTJForCausalLM(hf_cfg).to(dtype).train()


def baseline_step_fn(cfg, checkpointing: bool = False, dtype=torch.float32):
    return model_step_fn(cfg, hf_model(cfg, dtype), checkpointing)


def model_step_fn(cfg, model, checkpointing: bool = False):
    """One step of transformers' ``model``: each micro-batch's loss backward, clip_grad_norm_, AdamW."""
    if checkpointing:  # recomputes each layer in the backward, as ipuft always does
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    o, a = cfg.training.optimizer, cfg.plugins.adamw
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.learning_rate.maximum, betas=(a.beta1, a.beta2),
                                  eps=a.eps, weight_decay=a.weight_decay)

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        ga = batch.micro_batches
        for mb in range(ga):
            logits = model(batch.input_ids[mb]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels[mb].flatten())
            (loss / ga).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.gradient_clipping)
        optimizer.step()

    return step


def ipuft_step_fn(cfg, hooks):
    engine = build_engine(cfg, hooks)
    lr = cfg.training.optimizer.learning_rate.maximum
    return lambda batch: engine.step(batch, lr)


def timed(step, batch) -> float:
    start = time.perf_counter()
    step(batch)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--real", choices=sorted(REAL), help="a real checkpoint's shapes (see the docstring)")
    parser.add_argument("--processes", action="store_true", help="with --real: a process each runner")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # by_processes' runner processes
    parser.add_argument("--home", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    hooks = create_plugin_manager()
    if args.child:
        return child_main(args, hooks)
    if args.real:
        return real_main(args, hooks)
    sections = hooks.registrations.config_sections
    base = DEFAULTS + args.overrides
    variants = {"no_recompute": ["execution.offload=false", "execution.recompute=false"],
                "offload_off": ["execution.offload=false"], "offload_on": ["execution.offload=true"]}
    cfgs = {name: load_config("tiny", base + extra, sections) for name, extra in variants.items()}
    bf16 = load_config("tiny", base + ["model.precision=bfloat16", "training.stochastic_rounding=true"], sections)
    cfg = cfgs["offload_off"]
    batches = bench_batches(cfg, args.steps)

    runners = {"baseline": baseline_step_fn(cfg), "baseline_checkpointed": baseline_step_fn(cfg, checkpointing=True),
               **{n: ipuft_step_fn(c, hooks) for n, c in cfgs.items()},
               "baseline_bf16": baseline_step_fn(cfg, dtype=torch.bfloat16), "bf16_sr": ipuft_step_fn(bf16, hooks)}
    result = race(runners, batches, args.repeats, cfg)
    result.update({f"ratio_{n}": result[n] / result["baseline"] for n in cfgs})
    result.update({f"ratio_{n}_vs_checkpointed": result[n] / result["baseline_checkpointed"] for n in cfgs})
    result["ratio_bf16_sr"] = result["bf16_sr"] / result["baseline_bf16"]
    result["config"] = {"layers": cfg.model.layers, "hidden": cfg.model.hidden_size, "seq": cfg.model.sequence_length,
                        "gbs": cfg.training.global_batch_size, "ga": cfg.gradient_accumulation,
                        "threads": torch.get_num_threads()}
    if args.json:
        print(json.dumps(result))
        return
    print(f"config: {result['config']}")
    print(f"baseline (transformers GPTJForCausalLM + AdamW + clip_grad_norm_): {result['baseline']:10.1f} tokens/s")
    print(f"baseline with gradient checkpointing (recomputes, as ipuft):       "
          f"{result['baseline_checkpointed']:10.1f} tokens/s")
    for n in cfgs:
        print(f"ipuft {n:<12}: {result[n]:10.1f} tokens/s   ratio {result[f'ratio_{n}']:.2f}x   "
              f"(vs checkpointed {result[f'ratio_{n}_vs_checkpointed']:.2f}x)")
    print(f"baseline in bfloat16 (parameters and AdamW in bfloat16):        {result['baseline_bf16']:10.1f} tokens/s")
    print(f"ipuft bfloat16, stochastic rounding, offload on: {result['bf16_sr']:10.1f} tokens/s   "
          f"ratio {result['ratio_bf16_sr']:.2f}x")


if __name__ == "__main__":
    main()
