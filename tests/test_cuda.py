"""The CUDA path: pinned host memory, non-blocking copies and the prefetching side stream give the same
training as the CPU. Skipped where no GPU is available."""

import pytest
import torch
from test_engine import EQUIVALENCE, batches, make_engine, max_rel, run_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _exact_matmuls():
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@pytest.mark.parametrize(("offload", "placement"), [(True, "device"), (False, "device"), (True, "host")])
def test_cuda_training_matches_cpu(hooks, make_config, offload, placement):
    """With execution.optimizer_placement=host the GPU run updates in (pinned) host memory, after the
    gradients' non-blocking copies have landed."""
    common = (*EQUIVALENCE, f"execution.offload={offload}", "execution.activation_offload=true",
              f"execution.optimizer_placement={placement}")
    cfg_cpu = make_config(*common, "execution.device=cpu")
    cfg_gpu = make_config(*common, "execution.device=cuda")
    cpu = make_engine(cfg_cpu, hooks)
    from ipuft.engine.phased import PhasedEngine

    gpu = PhasedEngine(cfg_gpu, cpu.parts, cpu.optimizer, torch.device("cuda"))
    assert gpu.store.pin == offload
    cpu_results, gpu_results = run_engine(cpu, cfg_cpu), run_engine(gpu, cfg_gpu)
    for a, b in zip(cpu_results, gpu_results, strict=True):
        assert abs(a.loss - b.loss) / a.loss <= 1e-5 and abs(a.grad_norm - b.grad_norm) / a.grad_norm <= 1e-5
        assert a.traffic == b.traffic  # the same bytes cross, prefetched or not
    for unit, weights in cpu.model.weights().items():
        for name, w in weights.items():
            assert max_rel(gpu.model.weights()[unit][name].cpu(), w) <= 1e-5, f"{unit}.{name}"


def test_cuda_offload_keeps_variables_in_pinned_host_memory(hooks, make_config):
    cfg = make_config("execution.device=cuda")
    engine = make_engine(cfg, hooks)
    from ipuft.engine.phased import PhasedEngine

    engine = PhasedEngine(cfg, engine.parts, engine.optimizer, torch.device("cuda"))
    stored = engine.store.entries["decoder.0"]["fwd"]["attn.q_proj.weight"]
    assert stored.device.type == "cpu" and stored.is_pinned()
    result = engine.step(batches(cfg)[0], 1e-3)
    assert result.device_peak_bytes < sum(v.nbytes for v in engine.parts.variables["decoder"]) * cfg.model.layers * 4
    assert torch.cuda.max_memory_allocated() > 0


def test_cuda_profile_accounts_for_the_step(hooks, make_config):
    """Each section synchronises the device: the categories still sum to at most the measured step."""
    from ipuft.run.bench import benchmark

    cfg = make_config("execution.device=cuda", "training.global_batch_size=4", "execution.activation_offload=true")
    p = benchmark(cfg, hooks, timed_steps=2, profile=True)["profile"]
    covered = sum(p["seconds"].values())
    assert 0.5 * p["step_s"] <= covered <= p["step_s"]
    assert p["seconds"]["copies"] > 0 and p["seconds"]["collectives"] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_stochastic_rounding_equals_the_cpus(dtype):
    """The int32 hash (wrapping multiplies) and the rounding give the CPU's bits on the GPU, so a layout's
    ranks round alike on either device."""
    from ipuft.precision import random_bits, round_stochastically

    index = torch.cat([torch.arange(100_003), torch.arange(2**32 - 50, 2**32 + 50)])
    value = torch.randn(index.numel()) * 10.0 ** torch.randint(-8, 8, (index.numel(),)).float()
    bits = random_bits(77, index)
    assert torch.equal(random_bits(77, index.cuda()).cpu(), bits)
    ours = round_stochastically(value.cuda(), dtype, bits.cuda()).cpu()
    assert torch.equal(ours.view(torch.int16), round_stochastically(value, dtype, bits).view(torch.int16))


def test_unit_costs_on_the_gpu_count_what_the_cpu_counts(hooks, make_config):
    """Fake tensors on the CUDA device take its attention kernel, whose FLOP formula is the CPU kernel's; the
    matmuls are the same."""
    from ipuft.engine.model import build_model
    from ipuft.plan.measure import unit_cost

    cfg = make_config("model.hidden_size=128", "model.sequence_length=16")
    parts = build_model(cfg, hooks)
    for role in ("embeddings", "decoder", "head"):
        cpu, gpu = unit_cost(parts, role, cfg, "cpu"), unit_cost(parts, role, cfg, "cuda")
        assert (gpu.forward, gpu.backward, gpu.recompute) == (cpu.forward, cpu.backward, cpu.recompute), role


def test_this_gpu_takes_bfloat16_as_its_capability_says(make_config):
    from ipuft.errors import ConfigError
    from ipuft.kernels import require_precision_support

    cfg = make_config("model.precision=bfloat16", "training.stochastic_rounding=true")
    if torch.cuda.get_device_capability()[0] >= 8:
        require_precision_support(cfg, torch.device("cuda"))
    else:
        with pytest.raises(ConfigError, match="has no bfloat16 arithmetic"):
            require_precision_support(cfg, torch.device("cuda"))


@pytest.mark.parametrize(("dtype", "grad16"), [(torch.float32, False), (torch.bfloat16, False),
                                               (torch.bfloat16, True), (torch.float16, True)],
                         ids=["float32", "bf16-sr", "bf16-sr-bf16-grad", "fp16-sr-fp16-grad"])
def test_cuda_compiled_update_is_the_ops_bit_for_bit(dtype, grad16):
    """The device's one-pass update (``ipuft.engine.compiled``, one Triton kernel a piece) gives the CUDA ops'
    bits: weight and moments, with the factor, the floor, decay, stochastic rounding; in two pieces."""
    from test_fused_update import KEY, assert_same_bits, case, ops_update

    from ipuft.engine import compiled, fused
    from ipuft.optim import StepContext
    from ipuft_optim_adam.adamw import AdamW

    opt = AdamW(0.9, 0.999, 1e-6, weight_decay=0.1)
    ctx = StepContext(lr=3e-3, step=2, global_norm=4.0, grad_factor=0.37 / 64)
    start = {k: t.cuda() for k, t in case(dtype, 1 << 20, grad16=grad16).items()}
    ops = {k: t.clone() for k, t in start.items()}
    ops_update(opt, "h.0.mlp.weight", ops, ctx, 1000)
    got = {k: t.clone() for k, t in start.items()}
    cut = (1 << 20) // 3
    for a, b in ((0, cut), (cut, 1 << 20)):
        piece = {k: t[a:b] for k, t in got.items()}
        rounding = None if dtype == torch.float32 else (KEY, 1000 + a)
        assert fused.serves(piece["w"], piece["g"], rounding)
        fused.adamw_(piece["w"], piece["g"], piece["m"], piece["v"],
                     opt.scalars("h.0.mlp.weight", ctx, ctx.grad_factor), rounding)
    assert "failed" not in compiled._state
    assert_same_bits(got, ops)


@pytest.mark.parametrize("recipe", [(), ("model.precision=bfloat16", "training.stochastic_rounding=true"),
                                    ("training.optimizer.name=adamw8bit", "model.precision=bfloat16",
                                     "training.stochastic_rounding=true")],
                         ids=["float32", "bf16-sr", "adamw8bit-bf16-sr"])
def test_cuda_engine_updates_with_the_compiled_kernel(hooks, make_config, monkeypatch, recipe):
    """``optimizer_placement=device``: every update goes through the compiled kernels (``adamw8bit``'s codes
    too), and the run equals the torch ops' run (``IPUFT_COMPILED_UPDATE=0``) bit for bit."""
    from test_compiled_update import assert_same_runs, counted

    from ipuft.engine.phased import PhasedEngine

    calls = counted(monkeypatch)
    runs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("IPUFT_COMPILED_UPDATE", setting)
        calls.clear()
        common = [o.replace("plugins.adamw.", "plugins.adamw8bit.") if "adamw8bit" in str(recipe) else o
                  for o in EQUIVALENCE]
        cfg = make_config(*common, *recipe, "execution.optimizer_placement=device", "execution.device=cuda")
        cpu = make_engine(make_config(*common, *recipe, "execution.device=cpu"), hooks)
        gpu = PhasedEngine(cfg, cpu.parts, cpu.optimizer, torch.device("cuda"))
        runs[setting] = ([r.loss for r in run_engine(gpu, cfg)], gpu.model.full_weights(),
                         gpu.model.full_weights("optim"))
        assert bool(calls) == (setting == "1")
    assert_same_runs(runs["1"], runs["0"])
