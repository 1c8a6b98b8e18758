"""The ``ipuft`` commands: train, plan, bench, eval, generate, export, config show, plugins, and whatever
subcommands plugins add. :func:`run` is the error boundary: every error a user can cause is printed as one
line on stderr with exit code 2, never a traceback.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import click
from click.core import ParameterSource

from ipuft.cli.exit import fail
from ipuft.config import checkpoint_config, load_config, preset_names, to_yaml
from ipuft.config.rules import check_plugins
from ipuft.errors import IpuftError
from ipuft.io.hf_names import DEFAULT_SHARD_BYTES
from ipuft.plugins import DEBUG_ENV, PluginHooks, create_plugin_manager, debugging

DEFAULT_PRESET = "small-cpu"
PROMPTS_LIMIT = 1 << 28  # bytes of a --prompts file


def config_arguments(command: Callable) -> Callable:
    """``--config PRESET`` and ``KEY=VALUE ...`` overrides, resolved into ``cfg`` for the command."""

    @click.option("--config", "preset", default=DEFAULT_PRESET, show_default=True, metavar="PRESET",
                  help=f"A shipped preset ({', '.join(preset_names())}) or a path to a .yaml file. Without it, a "
                       f"checkpoint (model.hf_checkpoint, model.init_checkpoint) takes the finetune recipe.")
    @click.option("--checkpoint", "checkpoint", default=None, metavar="PATH",
                  help="Start from an ipuft checkpoint (or a run directory's latest): its config is the preset.")
    @click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
    @click.pass_obj
    @functools.wraps(command)
    def wrapper(hooks: PluginHooks, preset: str, checkpoint: str | None, overrides: tuple[str, ...], **kwargs):
        sections = hooks.registrations.config_sections
        context = click.get_current_context()
        context.meta["ipuft.overrides"] = overrides
        chosen = context.get_parameter_source("preset") is not ParameterSource.DEFAULT
        if checkpoint is not None:
            if chosen:
                raise click.UsageError(f"--config {preset} and --checkpoint {checkpoint}: a checkpoint's config is "
                                       f"the preset; give one of the two (and KEY=VALUE overrides)")
            cfg = checkpoint_config(checkpoint, sections, overrides)
        else:
            notes: list[str] = []
            cfg = load_config(preset, overrides, sections, default_preset=not chosen, notes=notes)
            if os.environ.get("RANK", "0") == "0":
                for note in notes:  # the fine-tuning recipe a checkpoint without --config takes
                    click.echo(f"ipuft: {note}", err=True)
        check_plugins(cfg, hooks.registrations)
        return command(hooks, cfg, **kwargs)

    return wrapper


def warn(cfg, training: bool = True) -> None:
    """The warnings of a command that computes, on rank 0: 16-bit updates that vanish (a command that trains),
    and 16-bit compute on a CPU without fast 16-bit kernels."""
    from ipuft.kernels import compute_device, slow_precision_warning
    from ipuft.precision import vanishing_updates_warning

    if os.environ.get("RANK", "0") != "0":
        return
    for warning in (vanishing_updates_warning(cfg) if training else None,
                    slow_precision_warning(cfg, compute_device(cfg))):
        if warning is not None:
            click.echo(f"ipuft: warning: {warning}", err=True)


def chosen_layout(hooks: PluginHooks, cfg, every: bool = False):
    """``cfg`` with ``execution.recompute`` and ``execution.offload`` ``auto`` chosen by the run's plan
    (:mod:`ipuft.run.layout`; ``every``: each allowed layout planned), and the choice (``None`` where neither is
    auto), said in one line on rank 0."""
    from ipuft.run.layout import choose_layout

    cfg, layout = choose_layout(cfg, hooks, every=every)
    if layout is not None and os.environ.get("RANK", "0") == "0":
        click.echo(f"ipuft: {layout.line}", err=True)
    return cfg, layout


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ipuft")
@click.option("--debug", is_flag=True, help="Errors come with their full traceback (as IPUFT_DEBUG=1 does).")
def cli(debug: bool) -> None:
    """Fine-tune causal language models (GPT-J, Llama, Mistral, Qwen2) larger than the accelerator's memory."""


@cli.command()
@config_arguments
def train(hooks: PluginHooks, cfg) -> None:
    """Fine-tune a model: the phased, offloaded training loop.

    \b
    Examples:
      ipuft train                                            # the small-cpu preset on the shipped sample
      ipuft train --config tiny training.steps=20 output_dir=runs/a
      ipuft train output_dir=runs/a checkpoint.load=latest   # resume runs/a where it stopped
      ipuft train model.hf_checkpoint=/models/gpt-j-6b data.path=train.jsonl model.precision=bfloat16 \\
          training.stochastic_rounding=true
    \b
    Main keys: training.steps, training.global_batch_size, execution.micro_batch_size,
    training.optimizer.learning_rate.maximum, model.precision, data.path, output_dir, checkpoint.load
    (ipuft config show lists them all).
    """
    from ipuft.run.train import train as run_training

    warn(cfg)
    run_training(chosen_layout(hooks, cfg)[0], hooks)


@cli.command()
@config_arguments
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(min=1),
              help="Rows decoded together in the inference view (generate, eval --task mnli).")
def plan(hooks: PluginHooks, cfg, as_json: bool, batch_size: int) -> None:
    """Print the step program and its memory and traffic estimate, without allocating the model, and
    whether the run fits this machine; then the memory of generate and eval for --batch-size rows.

    \b
    Examples:
      ipuft plan --config gptj-6b
      ipuft plan --config gptj-6b execution.data_parallel=8 --json
    """
    from ipuft.engine.model import build_model
    from ipuft.kernels import compute_device, require_precision_support
    from ipuft.plan.estimate import estimate
    from ipuft.plan.fit import fit, format_fit, format_plan
    from ipuft.units import format_bytes

    require_precision_support(cfg, compute_device(cfg))
    cfg, layout = chosen_layout(hooks, cfg, every=True)
    parts = build_model(cfg, hooks, hooks.registrations.build_optimizer(cfg))
    result = estimate(cfg, parts, hooks, batch_size)
    result["machine"] = fit(cfg, hooks, result)
    if layout is not None:  # each layout auto planned, the chosen one marked
        result["layouts"] = [{**each, "chosen": (each["recompute"], each["offload"]) == (layout.recompute,
                                                                                         layout.offload)}
                             for each in layout.planned]
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(format_plan(result))
        click.echo(format_fit(cfg, result["machine"]))
        for each in result.get("layouts", ()):
            device = each["device_needed_bytes"]
            click.echo(f"layout recompute={str(each['recompute']).lower()} offload={str(each['offload']).lower()}: "
                       f"host {format_bytes(each['host_needed_bytes'])}"
                       + (f", device {format_bytes(device)}" if device is not None else "")
                       + (" (chosen)" if each["chosen"] else ""))
    warn(cfg)


@cli.command()
@config_arguments
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--profile", is_flag=True,
              help="Then five profiled steps: where a step's time goes, by phase kind, copies and collectives.")
@click.option("--steps", default=5, show_default=True, type=click.IntRange(min=1),
              help="Timed steps after the untimed one (and as many profiled steps with --profile).")
@click.option("--trace", default=None, metavar="FILE", type=click.Path(dir_okay=False),
              help="Then one step recorded by torch.profiler, written to FILE as a Chrome trace (chrome://tracing, "
                   "Perfetto), with a range per phase; under torchrun, FILE's stem gets .rank<N>.")
def bench(hooks: PluginHooks, cfg, as_json: bool, profile: bool, steps: int, trace: str | None) -> None:
    """Build the program, run one untimed step, then five timed steps; print the throughput.

    \b
    Examples:
      ipuft bench --profile                              # the small-cpu preset, and where its time goes
      ipuft bench --config tiny --trace step.json --json
    """
    from ipuft.profiling import format_profile
    from ipuft.run.bench import benchmark

    if trace is not None:
        from ipuft.run.bench import check_trace_path

        check_trace_path(Path(trace))  # before the config's warnings and any compute
    warn(cfg)
    cfg = chosen_layout(hooks, cfg)[0]
    result = benchmark(cfg, hooks, timed_steps=steps, profile=profile, trace=None if trace is None else Path(trace))
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(f"Duration: {result['duration_s']:.4f} s  Throughput: {result['samples_per_s']:.1f} samples/s "
               f"{result['tokens_per_s']:.1f} tokens/s")
    peak, giga = result["matmul_peak"], 1e9
    shape = " × ".join(map(str, peak["shape"]))
    click.echo(f"Model FLOPs: {result['model_flops_per_s'] / giga:,.1f} GFLOP/s (and "
               f"{result['recompute_flops_per_s'] / giga:,.1f} recomputed): MFU {result['mfu']:.1%}, with the "
               f"recompute {result['hfu']:.1%}, of a {shape} {peak['dtype']} matmul's "
               f"{peak['flops_per_s'] / giga:,.1f} GFLOP/s on this device")
    if profile:
        click.echo(format_profile(result["profile"]))
    if trace is not None:
        click.echo(f"wrote {trace}")


@cli.command()
@click.option("--checkpoint", "checkpoint", required=True, metavar="PATH",
              help="An ipuft checkpoint, or a run directory (its latest checkpoint).")
@click.option("--hf", "out", default=None, metavar="OUT",
              help="The Hugging Face directory to write (new or empty): the whole model, adapters merged in.")
@click.option("--adapter", "adapter_out", default=None, metavar="OUT",
              help="A peft adapter directory to write (new, empty or an earlier adapter export) from a run with "
                   "model.adapter (LoRA): adapter_config.json and adapter_model.safetensors.")
@click.option("--gguf", "gguf_out", default=None, metavar="OUT.gguf",
              help="A GGUF file to write (new, or an earlier GGUF file, replaced) for llama.cpp, Ollama and LM "
                   "Studio: the whole model, adapters merged in, with its tokenizer and chat template (Llama, "
                   "Mistral, Qwen2/3, Gemma 3; needs pip install 'ipuft[gguf]').")
@click.option("--gguf-type", type=click.Choice(["f32", "f16", "bf16", "q8_0"]), default="f16", show_default=True,
              help="--gguf: the matrices' type (norms and biases stay f32; q8_0 rows not a multiple of 32 long: "
                   "f16).")
@click.option("--max-shard-size", default=DEFAULT_SHARD_BYTES, show_default=True, type=click.IntRange(min=1),
              help="Bytes per safetensors shard; larger models get an index.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="--hf and --adapter: the exported weights' dtype (config.json's torch_dtype); default: the "
                   "precision trained in.")
@click.pass_obj
def export(hooks: PluginHooks, checkpoint: str, out: str | None, adapter_out: str | None, gguf_out: str | None,
           gguf_type: str, max_shard_size: int, dtype: str | None) -> None:
    """Write a checkpoint as a Hugging Face directory of its family (GPT-J, Llama, Mistral, Qwen2/3, OLMo 2,
    Gemma 2/3, Phi-3): config.json and safetensors, and the checkpoint's tokenizer where it has one (--hf); its
    adapters as a peft adapter for the base model (--adapter); as one GGUF file that llama.cpp and Ollama run
    (--gguf); or several of these.

    \b
    Examples:
      ipuft export --checkpoint runs/a --hf out/model          # the whole model (LoRA merged in)
      ipuft export --checkpoint runs/a --adapter out/adapter   # PeftModel.from_pretrained(base, "out/adapter")
      ipuft export --checkpoint runs/a --gguf out/a.gguf       # llama-cli -m out/a.gguf (llama.cpp)
    """
    targets = {name: Path(path).resolve() for name, path in
               (("--hf", out), ("--adapter", adapter_out), ("--gguf", gguf_out)) if path is not None}
    if not targets:
        raise click.UsageError("export: give --hf OUT (the whole model), --adapter OUT (a peft adapter), "
                               "--gguf OUT.gguf (for llama.cpp), or several")
    for first, second in itertools.combinations(targets, 2):
        if targets[first].is_relative_to(targets[second]) or targets[second].is_relative_to(targets[first]):
            given = {"--hf": out, "--adapter": adapter_out, "--gguf": gguf_out}
            place = "file" if "--gguf" in (first, second) else "directory"
            raise click.UsageError(f"export: {first} {given[first]} and {second} {given[second]} overlap; give "
                                   f"each its own {place}")
    if dtype is not None and out is None and adapter_out is None:
        raise click.UsageError("export: --dtype is the type of --hf and --adapter; --gguf takes --gguf-type")
    if out is not None:
        from ipuft.run.export import export_hf

        click.echo(f"wrote {export_hf(checkpoint, out, hooks, max_shard_size, dtype)}")
    if adapter_out is not None:
        from ipuft.run.export import export_adapter

        click.echo(f"wrote {export_adapter(checkpoint, adapter_out, hooks, dtype)}")
    if gguf_out is not None:
        from ipuft.run.export import export_gguf

        click.echo(f"wrote {export_gguf(checkpoint, gguf_out, hooks, gguf_type)}")


@cli.command("eval")
@config_arguments
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with tokens_per_s, device_peak_bytes).")
@click.option("--task", type=click.Choice(["loss", "mnli"]), default="loss", show_default=True,
              help="loss: mean token loss and perplexity; mnli: label accuracy.")
@click.option("--mode", type=click.Choice(["score", "generate"]), default="score", show_default=True,
              help="--task mnli: score compares each label's log-likelihood after the prompt (one forward pass); "
                   "generate decodes the label greedily, as the reference did.")
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(min=1),
              help="--task mnli: rows per layer-major pass (the loss task uses execution.micro_batch_size).")
def eval_command(hooks: PluginHooks, cfg, as_json: bool, task: str, mode: str, batch_size: int) -> None:
    """Evaluate on data.path. Weights come from checkpoint.load or model.hf_checkpoint; they stay in host
    memory and come to the device one unit at a time, as in training.

    \b
    Examples:
      ipuft eval --checkpoint runs/a data.path=val.jsonl              # loss and perplexity
      ipuft eval --checkpoint runs/a data.path=val.jsonl --task mnli  # label accuracy by log-likelihood
      ipuft eval --checkpoint runs/a data.path=val.jsonl --task mnli --mode generate --batch-size 32
      ipuft eval --checkpoint runs/a                                  # its run's data.validation_path
    """
    from ipuft.run.evaluate import evaluate_loss, evaluate_mnli

    typed = {item.partition("=")[0] for item in click.get_current_context().meta.get("ipuft.overrides", ())}
    validation = None
    if cfg.checkpoint.load is not None and "data.path" not in typed:
        if cfg.data.validation_path is None and not cfg.data.validation_fraction:
            raise click.UsageError("eval: give data.path=FILE, the data to evaluate on (a checkpoint's own data.path "
                                   "is the data it was trained on, and its run set no validation rows)")
        from ipuft.data.tokens import validation_source

        validation = validation_source(cfg)  # the run's validation split
    if cfg.checkpoint.load is None and cfg.model.hf_checkpoint is None:
        click.echo("ipuft: note: no checkpoint.load or model.hf_checkpoint: evaluating random weights", err=True)
    if validation is not None and task == "mnli":
        raise click.UsageError("eval --task mnli: give data.path=FILE with MNLI rows")
    warn(cfg, training=False)
    result = evaluate_mnli(cfg, hooks, mode, batch_size) if task == "mnli" else evaluate_loss(cfg, hooks, validation)
    if as_json:
        click.echo(json.dumps(result))
    elif task == "mnli":
        click.echo(f"accuracy {result['accuracy']:.4f} ({result['correct']}/{result['examples']}, {mode})")
    else:
        click.echo(f"loss {result['loss']:.4f}  perplexity {result['perplexity']:.3f}  tokens {result['tokens']}")


def conversation_line(line: str, where: str) -> list:
    """One line of a --chat .jsonl prompts file: a JSON list of messages, or an object holding one as ``messages``
    (checked, as training rows are, when it is rendered)."""
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        raise click.UsageError(f"{where}: not valid JSON; expected a list of {{role, content}} messages") from None
    if isinstance(value, dict):
        value = value.get("messages")
    if not isinstance(value, list):
        raise click.UsageError(f"{where}: expected a list of {{role, content}} messages, or an object with messages")
    return value


@cli.command()
@click.option("--checkpoint", "path", required=True, metavar="PATH",
              help="An ipuft checkpoint or run directory, or a Hugging Face directory (GPT-J, Llama, Mistral, Qwen2).")
@click.option("--prompts", "prompts_file", default=None, metavar="FILE", type=click.Path(dir_okay=False),
              help="A UTF-8 file of prompts, one per line (then every argument is a KEY=VALUE override).")
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(min=1),
              help="Prompts decoded together: each unit's weights come to the device once per step for all of them.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="0: greedy decoding.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0), help="0: off.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(min=0.0, max=1.0, min_open=True))
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the sampling.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: completions, new_tokens, tokens_per_s, device_peak_bytes.")
@click.option("--chat", is_flag=True,
              help="Each PROMPT (each line of --prompts) is a user message, or with a .jsonl --prompts each line a "
                   "conversation ([{role, content}, ...]); rendered by the model's chat template (data.chat_template "
                   "overrides it) with the generation prompt; each reply stops at the end of its turn.")
@click.argument("args", nargs=-1, metavar="[PROMPT] [KEY=VALUE]...")
@click.pass_obj
def generate(hooks: PluginHooks, path: str, prompts_file: str | None, batch_size: int, max_new_tokens: int,
             temperature: float, top_k: int, top_p: float, seed: int, as_json: bool, chat: bool,
             args: tuple[str, ...]) -> None:
    """Continue PROMPT (or every line of --prompts FILE) with a KV cache, greedily or by sampling; each
    row stops at an eos token (model.eos_token_ids; unset, <|endoftext|>). Weights stay in host memory and
    come to the device one unit at a time.

    \b
    Examples:
      ipuft generate --checkpoint runs/a "mnli hypothesis: ... target:"
      ipuft generate --checkpoint runs/a --prompts prompts.txt --batch-size 16 --json
      ipuft generate --checkpoint /models/gpt-j-6b --temperature 0.8 --top-p 0.9 "Once upon" data.tokenizer=DIR
      ipuft generate --checkpoint runs/chat --chat "Name three primes."
      ipuft generate --checkpoint runs/chat --chat --prompts conversations.jsonl
    """
    from ipuft.run.generate import check_sampling, generate_texts, inference_config

    check_sampling(max_new_tokens, temperature, top_k, top_p, seed)  # before any model is read
    if prompts_file is None:
        if not args:
            raise click.UsageError("give a PROMPT, or --prompts FILE")
        prompts, overrides = [args[0]], args[1:]
    else:
        from ipuft.io.files import read_bounded

        # bounded: a prompt file is text, never gigabytes (nor a FIFO or a device)
        data = read_bounded(prompts_file, PROMPTS_LIMIT, f"--prompts {prompts_file}:", click.UsageError, "; split it")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise click.UsageError(f"--prompts {prompts_file}: cannot be read ({exc})") from None
        prompts, overrides = [line for line in text.splitlines() if line.strip()], args
        if not prompts:
            raise click.UsageError(f"--prompts {prompts_file}: no prompt in it (one per line)")
        if chat and prompts_file.lower().endswith(".jsonl"):
            prompts = [conversation_line(line, f"--prompts {prompts_file} line {number}")
                       for number, line in enumerate(prompts, start=1)]
    cfg = inference_config(path, hooks, overrides)
    warn(cfg, training=False)
    result = generate_texts(cfg, hooks, prompts, max_new_tokens, batch_size, chat=chat, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=seed)
    if as_json:
        click.echo(json.dumps(result))
    else:
        for completion in result["completions"]:
            click.echo(completion)


@cli.group("config")
def config_group() -> None:
    """Inspect the resolved config."""


@config_group.command("show")
@config_arguments
def config_show(hooks: PluginHooks, cfg) -> None:
    """Print the resolved config (schema ← preset ← overrides) as YAML."""
    click.echo(to_yaml(cfg), nl=False)


@cli.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@click.pass_obj
def plugins_command(hooks: PluginHooks, as_json: bool) -> None:
    """List the installed plugins: name, distribution, version and what each registers."""
    described = hooks.describe()
    if as_json:
        click.echo(json.dumps(described, indent=2))
        return
    for p in described:
        click.echo(f"{p['name']}  ({p['distribution']} {p['version']})")
        for kind in ("components", "optimizers", "loggers", "config_sections", "model_families"):
            if p[kind]:
                click.echo(f"    {kind.replace('_', ' ')}: {', '.join(p[kind])}")


def run(argv: list[str] | None = None) -> None:
    """Run the command line on ``argv``; see :func:`ipuft.cli.main.main`."""
    args = sys.argv[1:] if argv is None else list(argv)
    program = argv is None  # the process is ours to end (not a caller's, such as a test's)
    if "--debug" in args[: args.index("--")] if "--" in args else "--debug" in args:
        os.environ[DEBUG_ENV] = "1"  # before the plugins load, so that their import errors show tracebacks too
    try:
        hooks = create_plugin_manager()
        hooks.registrations  # noqa: B018 - surface registration errors before any command runs
        hooks.register_commands(cli)
        cli.main(args=argv, prog_name="ipuft", obj=hooks, standalone_mode=False)
        if _in_process_group():
            from ipuft.parallel import leave

            leave()
    except IpuftError as exc:
        if debugging():
            traceback.print_exception(exc)
        fail(str(exc), exc.exit_code, at_once=program and _in_process_group())
    except click.exceptions.Abort:  # click's form of a KeyboardInterrupt
        fail("aborted", 130, at_once=program)
    except click.ClickException as exc:
        fail(exc.format_message(), exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        fail("interrupted", 130, at_once=program)


def _in_process_group() -> bool:
    """Whether this process joined a torch.distributed process group (checked without importing torch).

    A command that completed leaves the group on every rank. One that failed while in a group ends the
    process at once instead (as a Ctrl-C does, see :func:`ipuft.cli.exit.fail`): a peer may still be in a
    collective with this rank, or, after a timed-out collective, Gloo's thread may still wait in it, and
    tearing the group down would then hang or abort."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()

