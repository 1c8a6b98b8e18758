"""LoRA, the shipped plugin (``ipuft-lora``, ``model.adapter=lora``): against peft on transformers' models.

On a tiny random Llama every target (q, k, v, o, gate, up, down), three AdamW steps with global-norm clipping
and weight decay equal peft's LoraConfig with the same initial adapters and torch.optim.AdamW; the peft
adapter export, loaded by ``PeftModel.from_pretrained``, and the merged export give ipuft's logits; GPT-J the
same through peft; TP=2 (column- and row-parallel targets, key/value heads split and replicated) and DP=2 with
RTS equal one process; bfloat16 equals a plain bfloat16 reference; the plan's bytes are the engine's."""

import json

import pytest
import torch
import torch.nn.functional as F
from llama_reference import hf_model, save_hf
from test_engine import max_rel
from test_llama import equal_to_one_process

from ipuft.components import IGNORE_INDEX
from ipuft.config import load_config
from ipuft.data.tokens import data_source
from ipuft.engine.inference import LayerMajor
from ipuft.engine.model import build_model
from ipuft.errors import CheckpointError, ConfigError
from ipuft.plan.estimate import estimate
from ipuft.plugins import create_plugin_manager
from ipuft.run.export import export_adapter, export_hf
from ipuft.run.generate import inference_config
from ipuft.run.runtime import build_engine, inference_engine
from ipuft.run.schedule import learning_rate
from ipuft.run.train import replica_batch, train

ALL = ["q", "k", "v", "o", "gate", "up", "down"]
LLAMA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RECIPE = ["training.global_batch_size=4", "execution.micro_batch_size=2", "training.steps=3",
          "training.optimizer.learning_rate.maximum=2e-2", "training.optimizer.gradient_clipping=0.05",
          "plugins.adamw.weight_decay=0.1", "plugins.adamw.eps=1e-5"]


def lora(*targets, rank=4, alpha=8.0):
    return ["model.adapter=lora", f"plugins.lora.rank={rank}", f"plugins.lora.alpha={alpha}",
            f"plugins.lora.targets=[{','.join(targets)}]"]


def config(hooks, src, *extra):
    return load_config(None, [f"model.hf_checkpoint={src}", "model.sequence_length=16", *extra],
                       hooks.registrations.config_sections)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_hf(tmp_path_factory.mktemp("lora") / "llama", "llama", seed=3)[1]


def peft_model(base, modules, engine, rank=4, alpha=8.0):
    """peft's LoRA on ``base`` with ipuft's initial adapters copied in (B zeros in both)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=modules))
    ours = adapters(engine)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(ours[name.replace(".default.", ".")])
    return model


def adapters(engine) -> dict:
    """ipuft's adapter weights under peft's names (those of ``adapter_model.safetensors``)."""
    weights, decoder = engine.model.full_weights(), engine.modules["decoder"]
    return {peft: weights[f"decoder.{n}"][local] for n in range(engine.cfg.model.layers)
            for local, peft in decoder.peft_mapping(n).items()}


def peft_adam_steps(model, cfg, engine, step_engine=True):
    """``cfg``'s steps of ``engine`` and of peft's ``model`` with torch.optim.AdamW, clipped as ipuft clips
    (``g · C / max(N, C)``, N over the trainable gradients); per step both losses and norms. ``step_engine=False``:
    peft's steps alone, on the batches ``engine``'s layout reads (its losses and norms then ``None``)."""
    steps, clip, data = cfg.training.steps, cfg.training.optimizer.gradient_clipping, data_source(cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    o = cfg.plugins.adamw
    adam = torch.optim.AdamW(trainable, lr=1.0, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    out = []
    for step in range(steps):
        batch = replica_batch(cfg, data, step, engine.layout)
        lr = learning_rate(step, steps, cfg.training.optimizer.learning_rate)
        result = engine.step(batch, lr) if step_engine else None
        adam.zero_grad()
        losses = []
        for mb in range(batch.micro_batches):
            logits = model(input_ids=batch.input_ids[mb]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), batch.labels[mb].flatten(), ignore_index=IGNORE_INDEX)
            (loss / batch.micro_batches).backward()
            losses.append(loss.item())
        norm = torch.stack([p.grad.double().norm() for p in trainable]).norm().item()
        for p in trainable:
            p.grad.mul_(clip / max(norm, clip))
        adam.param_groups[0]["lr"] = lr
        adam.step()
        out.append(((result and result.loss, sum(losses) / len(losses)), (result and result.grad_norm, norm)))
    return out


# The Llama-architecture families LoRA runs on, each through the projections its decoder declares.
FAMILIES = ["llama", "qwen2", "qwen3", "olmo2", "gemma2", "gemma3_text"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_three_adamw_steps_equal_peft_with_torch_adamw(hooks, llama_dir, tmp_path, kind):
    """Every target of a Llama (and of a Qwen2, whose q, k and v have biases; a Qwen3 and a Gemma 3 with q/k
    norms; an OLMo 2 with post-norms), clipping active, weight decay on the adapters: losses and norms within
    1e-5 of peft's; every adapter as near peft's in float64 as peft's own in float32 is; the base bit-identical,
    with no gradient or optimizer state stored."""
    src = llama_dir if kind == "llama" else save_hf(tmp_path / kind, kind, seed=3)[1]
    cfg = config(hooks, src, *RECIPE, *lora(*ALL))  # the default chunked head
    engine = build_engine(cfg, hooks)
    before = engine.model.full_weights()
    exact = peft_model(hf_model(kind, seed=3).double(), LLAMA_MODULES, engine)
    peft_adam_steps(exact, cfg, engine, step_engine=False)
    model = peft_model(hf_model(kind, seed=3), LLAMA_MODULES, engine)
    results = peft_adam_steps(model, cfg, engine)
    assert results[0][1][1] > 2 * cfg.training.optimizer.gradient_clipping  # clipping is active
    for (loss, peft_loss), (norm, peft_norm) in results:
        assert abs(loss - peft_loss) <= 1e-5 * abs(peft_loss)
        assert abs(norm - peft_norm) <= 1e-5 * peft_norm

    def trained(m):
        return {name.replace(".default.", "."): p.detach().double() for name, p in m.named_parameters()
                if p.requires_grad}

    theirs, truth, ours = trained(model), trained(exact), adapters(engine)
    assert ours.keys() == theirs.keys() and len(ours) == 2 * 7 * 2
    # Adam's m / (sqrt(v) + eps) divides out a gradient's size, so float32's last bits (the order of a sum, a
    # fused AdamW against torch's lerp) come back as whole relative differences where m nearly cancels: peft in
    # float32 is itself 6e-6 to 9e-5 from float64 here, and ipuft 2e-6 to 2.2e-5 from it. The bound is float64's
    # answer: ipuft's farthest adapter no farther from it than 3 times peft-in-float32's (measured 0.81-1.30 on an
    # AVX-512 Xeon, up to 2.09 on an AVX2 Zen 3, whose matmuls round otherwise; a wrong formula is orders away).
    peft_error = max(max_rel(theirs[n], truth[n]) for n in truth)
    for name, p in truth.items():
        assert max_rel(ours[name].double(), p) <= 3 * peft_error, name
        assert max_rel(ours[name].double(), theirs[name]) <= 1e-4, name  # and each near peft's in float32
    after = engine.model.full_weights()
    for unit, tensors in before.items():
        for name, t in tensors.items():
            assert torch.equal(after[unit][name], t) == (".lora_" not in name), f"{unit}.{name}"
    for unit, entry in engine.store.entries.items():
        assert set(entry.get("grad", {})) | {n.variable for n in entry.get("optim", {})} <= {
            n for n in entry["fwd"] if ".lora_" in n}, unit


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory, llama_dir):
    """Six steps of LoRA on q, v, o and down from the Llama checkpoint, with its checkpoint."""
    hooks = create_plugin_manager()
    out = tmp_path_factory.mktemp("run") / "llama"
    cfg = config(hooks, llama_dir, *RECIPE[:2], "training.steps=6", "training.optimizer.learning_rate.maximum=2e-2",
                 *lora("q", "v", "o", "down"), f"output_dir={out}")
    records = train(cfg, hooks, progress=False)
    return cfg, out, records


def eval_logits(hooks, run, ids):
    return LayerMajor(inference_engine(inference_config(str(run), hooks), hooks)).logits(ids)


def test_the_peft_adapter_export_loads_in_peft_and_gives_ipufts_logits(hooks, llama_run, llama_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, out, _ = llama_run
    exported = export_adapter(out, tmp_path / "adapter", hooks)
    written = json.loads((exported / "adapter_config.json").read_text())
    assert (written["peft_type"], written["r"], written["lora_alpha"], written["task_type"]) == (
        "LORA", 4, 8.0, "CAUSAL_LM")
    assert written["target_modules"] == ["down_proj", "o_proj", "q_proj", "v_proj"]
    assert written["base_model_name_or_path"] == str(llama_dir)
    ids = torch.randint(0, 101, (3, 16), generator=torch.Generator().manual_seed(1))
    ours = eval_logits(hooks, out, ids)
    base = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    with torch.no_grad():
        before = base(ids).logits
        peft = PeftModel.from_pretrained(base, exported).eval()
        theirs = peft(input_ids=ids).logits
    assert (ours - theirs).abs().max() <= 1e-5
    assert (ours - before).abs().max() > 1e-3  # the adapters changed the model
    merged = AutoModelForCausalLM.from_pretrained(export_hf(out, tmp_path / "merged", hooks)).eval()
    with torch.no_grad():
        assert (merged(ids).logits - theirs).abs().max() <= 1e-5


def test_the_adapter_export_refuses_what_is_not_its_own(hooks, llama_run, tmp_path):
    _, out, _ = llama_run
    (tmp_path / "file").write_text("x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    for target in ("file", "busy"):
        with pytest.raises(CheckpointError, match=rf"^--adapter {tmp_path / target} exists and is not an empty"):
            export_adapter(out, tmp_path / target, hooks)
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "x"
    first = export_adapter(out, tmp_path / "again", hooks)
    data = (first / "adapter_model.safetensors").read_bytes()
    export_adapter(out, tmp_path / "again", hooks)  # an earlier adapter export is replaced whole
    assert (first / "adapter_model.safetensors").read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "busy", "file"]  # no temporary left


@pytest.mark.parametrize("kind", ["qwen3", "olmo2", "gemma3_text"])
def test_each_familys_adapter_export_gives_ipufts_logits_through_peft(hooks, tmp_path, kind):
    """Three LoRA steps on every target of a family described since Llama: peft's adapter from ``export
    --adapter`` on transformers' model gives ipuft's eval logits, and the merged export the same."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, src = save_hf(tmp_path / kind, kind, seed=5)
    run = tmp_path / "run"
    cfg = config(hooks, src, *RECIPE[:2], "training.steps=3", *lora(*ALL),
                 "training.optimizer.learning_rate.maximum=2e-2", f"output_dir={run}")
    train(cfg, hooks, progress=False)
    exported = export_adapter(run, tmp_path / "adapter", hooks)
    assert json.loads((exported / "adapter_config.json").read_text())["target_modules"] == sorted(LLAMA_MODULES)
    ids = torch.randint(0, 101, (3, 16), generator=torch.Generator().manual_seed(1))
    ours = eval_logits(hooks, run, ids)
    with torch.no_grad():
        before = base(ids).logits
        theirs = PeftModel.from_pretrained(base, exported).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(export_hf(run, tmp_path / "merged", hooks)).eval()(ids).logits
    # Float32 rounding relative to the logits' size: Gemma 3's reach 3 at these weights (1.3e-5 apart measured).
    bound = 1e-5 * max(1.0, theirs.abs().max().item())
    assert (ours - theirs).abs().max() <= bound
    assert (ours - before).abs().max() > 1e-3  # the adapters changed the model
    assert (merged - theirs).abs().max() <= bound


def test_gptj_adapter_export_gives_ipufts_logits_through_peft(hooks, tmp_path):
    """GPT-J with every target it has (q, k, v, o, up=fc_in, down=fc_out): peft's adapter on transformers'
    GPTJForCausalLM gives ipuft's eval logits, and the merged export the same."""
    from peft import PeftModel
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(0)
    base = GPTJForCausalLM(GPTJConfig(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                      n_inner=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)).eval()
    base.save_pretrained(tmp_path / "gptj")
    run = tmp_path / "run"
    cfg = config(hooks, tmp_path / "gptj", *RECIPE[:2], "training.steps=3", *lora("q", "k", "v", "o", "up", "down"),
                 "training.optimizer.learning_rate.maximum=2e-2", f"output_dir={run}")
    train(cfg, hooks, progress=False)
    exported = export_adapter(run, tmp_path / "adapter", hooks)
    assert json.loads((exported / "adapter_config.json").read_text())["target_modules"] == [
        "fc_in", "fc_out", "k_proj", "out_proj", "q_proj", "v_proj"]
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(1))
    ours = eval_logits(hooks, run, ids)
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(base, exported).eval()(input_ids=ids).logits
        merged = GPTJForCausalLM.from_pretrained(export_hf(run, tmp_path / "merged", hooks)).eval()(ids).logits
    assert (ours - theirs).abs().max() <= 1e-5
    assert (merged - theirs).abs().max() <= 1e-5


def test_tensor_and_data_parallel_lora_equal_one_process(hooks, tmp_path):
    """TP=2 with every target (q, k, v, gate, up column-parallel; o and down row-parallel), with the key/value
    heads split (2) and replicated (3: both adapters' gradients summed over TP), GPT-J at TP=2, and DP=2 with
    RTS: three clipped steps on two Gloo ranks equal one process; every rank's counters and store its plan."""
    dirs = {kv: save_hf(tmp_path / f"kv{kv}", "llama", seed=7, num_key_value_heads=kv)[1] for kv in (2, 3)}
    common = ["model.sequence_length=16", "execution.micro_batch_size=1", "training.steps=3",
              "training.optimizer.gradient_clipping=0.05", "training.optimizer.learning_rate.maximum=5e-3",
              "plugins.adamw.weight_decay=0.1", "plugins.adamw.eps=1e-4", *lora(*ALL)]
    gptj = [o for o in common if not o.startswith("plugins.lora.targets")] + ["plugins.lora.targets=[q,v,o,up,down]"]
    configs = {"tp2_kv2": [f"model.hf_checkpoint={dirs[2]}", "execution.tensor_parallel=2",
                           "training.global_batch_size=2", *common],
               "tp2_kv3": [f"model.hf_checkpoint={dirs[3]}", "execution.tensor_parallel=2",
                           "training.global_batch_size=2", *common],
               "tp2_gptj": ["model.layers=2", "model.hidden_size=64", "model.attention.heads=4",
                            "model.attention.rotary_dim=8", "model.embedding.vocab_size=128",
                            "execution.tensor_parallel=2", "training.global_batch_size=2", *gptj],
               "dp2_rts": [f"model.hf_checkpoint={dirs[3]}", "execution.data_parallel=2", "execution.rts=true",
                           "training.global_batch_size=4", *common]}
    for name, (results, _) in equal_to_one_process(hooks, configs, 3, tmp_path).items():
        assert results[1].grad_norm > 0.05, name  # clipping is active (B is zero in the first step)


def test_bfloat16_lora_equals_a_plain_bfloat16_reference(hooks, llama_dir):
    """bfloat16 with stochastic rounding: the phased engine against a plain bfloat16 autograd reference of the
    same adapted modules, within the bounds :func:`test_precision.assert_16bit_close` justifies."""
    from test_engine import EQUIVALENCE, batches
    from test_precision import BF16_SR, assert_16bit_close, plain_16bit_reference

    shapes = [o for o in EQUIVALENCE if not o.startswith("model.layers")]
    cfg = config(hooks, llama_dir, *shapes, "training.global_batch_size=4", *BF16_SR, *lora(*ALL))
    engine = build_engine(cfg, hooks)
    initial = {u: {n: t.clone() for n, t in w.items()} for u, w in engine.model.weights().items()}
    step_batches = batches(cfg)
    results = [engine.step(b, learning_rate(s, cfg.training.steps, cfg.training.optimizer.learning_rate))
               for s, b in enumerate(step_batches)]
    def frozen(unit, name):
        return ".lora_" not in name

    expected = plain_16bit_reference(cfg, engine.modules, initial, step_batches, {}, frozen)
    float32 = plain_16bit_reference(cfg, engine.modules, {u: {n: t.float() for n, t in w.items()}
                                                          for u, w in initial.items()}, step_batches, {}, frozen)[2]
    assert_16bit_close(cfg, results, engine.model.weights(), expected, float32, torch.bfloat16)


def test_the_plan_counts_the_adapters_and_the_frozen_base(hooks):
    """llama3-8b with LoRA rank 16 on q, k, v, o: the plan's trainable parameters are the adapters'; its host
    bytes are every weight plus the adapters' gradient and AdamW state, exactly, and less than the full
    fine-tune's by the base's gradients and state; the engine's store (a 2-layer, narrower model of the same
    recipe, built for real) holds what its plan says, and its step moves what the plan says."""
    sections = hooks.registrations.config_sections
    full = load_config("llama3-8b", [], sections)
    adapted = load_config("llama3-8b", lora("q", "k", "v", "o", rank=16), sections)
    plans = {name: estimate(c, build_model(c, hooks), hooks) for name, c in (("full", full), ("lora", adapted))}
    m = adapted.model
    kv = adapted.plugins.llama.kv_heads * m.hidden_size // m.attention.heads
    # A [16, in] and B [out, 16] of q (4096 → 4096), k and v (4096 → 1024) and o (4096 → 4096), per layer.
    per_layer = 16 * ((4096 + 4096) + 2 * (4096 + kv) + (4096 + 4096))
    assert plans["lora"]["trainable_parameters"] == m.layers * per_layer
    assert plans["lora"]["parameters"] == plans["full"]["parameters"] + m.layers * per_layer
    assert plans["full"]["trainable_parameters"] == plans["full"]["parameters"]
    small = ["model.layers=2", "model.hidden_size=64", "model.attention.heads=4", "model.attention.rotary_dim=16",
             "plugins.llama.kv_heads=2", "model.intermediate_size=96", "model.embedding.vocab_size=128",
             "model.sequence_length=16", "training.global_batch_size=2", "execution.micro_batch_size=1",
             "model.bos_token_id=1", "model.eos_token_ids=[2]"]
    cfg = load_config("llama3-8b", [*small, *lora("q", "k", "v", "o", rank=16)], sections)
    engine = build_engine(cfg, hooks)
    planned = estimate(cfg, engine.parts, hooks)
    acts = planned["activation_bytes"] if cfg.execution.activation_offload else 0
    assert engine.store.host_bytes() == planned["host_bytes"] - acts
    result = engine.step(replica_batch(cfg, data_source(cfg), 0, engine.layout), 1e-3)
    assert result.traffic == planned["traffic"]
    adapters = 2 * 16 * ((64 + 64) + 2 * (64 + 32) + (64 + 64))
    assert planned["trainable_parameters"] == adapters
    weights = sum(t.numel() * t.element_size() for w in engine.model.weights().values() for t in w.values())
    grads = sum(t.numel() * t.element_size() for e in engine.store.entries.values() for t in e.get("grad", {}).values())
    optim = sum(t.numel() * t.element_size() for e in engine.store.entries.values() for t in e.get("optim", {}).values())
    assert optim == 2 * 4 * adapters  # AdamW's m and v, float32, of the adapters alone
    assert grads <= 4 * adapters  # the adapters' gradients at most (float32), none of the base
    assert weights + grads + optim == engine.store.host_bytes(), (weights, grads, optim, engine.store.host_bytes())
    # On the device, phase by phase: a layer's update streams its adapters and their state alone, exactly as the plan declares (the ledger's peak above what the phase found); a computing
    # phase at least what it loads; the step's peak within the plan's.
    phases = {p["phase"]: p["device"] for p in planned["program"]}
    measured = engine.step(replica_batch(cfg, data_source(cfg), 1, engine.layout), 1e-3)
    per_layer = adapters // 2
    for name, held in phases.items():
        if name.startswith("decoder.") and name.endswith(":optimizer_step"):
            assert held["loaded"] + held["update"] == measured.phase_peak_bytes[name]
            # Nothing loaded whole: the update streams the adapters, their gradients (16-bit, as the weights),
            # m and v (float32) in pieces, each piece at least once on the device.
            entry = engine.store.entries[name.split(":")[0]]
            grad = sum(t.numel() * t.element_size() for t in entry["grad"].values())
            state = sum(t.numel() * t.element_size() for t in entry["optim"].values())
            assert grad == 2 * per_layer and state == 8 * per_layer
            assert held["loaded"] == 0 and held["update"] >= 2 * grad + state, (name, held)
        assert measured.phase_peak_bytes[name] >= held["loaded"], name
    assert measured.device_peak_bytes <= planned["device_peak_bytes"]


def test_bad_lora_settings_are_one_line(hooks, llama_dir):
    sections = hooks.registrations.config_sections
    gptj = load_config("tiny", lora("gate"), sections)
    with pytest.raises(ConfigError, match=r"^plugins.lora.targets: the gptj decoder has no gate projection; choose "
                                          r"among q, k, v, o, up, down$"):
        build_model(gptj, hooks)
    with pytest.raises(ConfigError, match=r"^plugins.lora.targets: \['q_proj'\] must be distinct names among q, k"):
        build_model(load_config("tiny", lora("q_proj"), sections), hooks)
    with pytest.raises(ConfigError, match=r"^plugins.lora.rank: must be in \[1, 4096\], got 0$"):
        build_model(load_config("tiny", lora("q", rank=0), sections), hooks)
    with pytest.raises(ConfigError, match=r"plugins.lora.rank \(used when model.adapter=lora\): it is set but"):
        load_config("tiny", ["plugins.lora.rank=4"], sections)
    with pytest.raises(ConfigError, match=r"^model.adapter: no installed plugin adapts a model with 'dora'"):
        build_model(load_config("tiny", ["model.adapter=dora"], sections), hooks)


def test_adapter_dropout_masks_match_between_forward_and_recompute(hooks, llama_dir):
    """``plugins.lora.dropout`` with the model's own dropout off: the engine seeds the adapters' masks alike in
    a layer's forward and its recompute, so recomputing gives the steps of keeping the forward's graphs."""
    runs = {}
    for recompute in (True, False):
        cfg = config(hooks, llama_dir, *RECIPE, *lora(*ALL), "plugins.lora.dropout=0.5",
                     f"execution.recompute={str(recompute).lower()}", "execution.offload=false")
        engine = build_engine(cfg, hooks)
        data = data_source(cfg)
        results = [engine.step(replica_batch(cfg, data, s, engine.layout), 2e-2) for s in range(3)]
        runs[recompute] = [(r.loss, r.grad_norm) for r in results], adapters(engine)
    (steps, weights), (kept, kept_weights) = runs[True], runs[False]
    assert steps == kept
    assert all(torch.equal(weights[n], kept_weights[n]) for n in weights)
    cfg = config(hooks, llama_dir, *RECIPE, *lora(*ALL))
    engine = build_engine(cfg, hooks)
    plain = engine.step(replica_batch(cfg, data_source(cfg), 0, engine.layout), 2e-2)
    assert plain.loss == steps[0][0]  # B is zero: the first step's loss is the base model's, masks or not
    assert plain.grad_norm != steps[0][1]  # but the masks reach the adapters' gradients


def test_export_on_the_command_line_writes_an_adapter_or_says_what_is_wrong(capsys, llama_run, trained, tmp_path):
    from cli_helpers import run_cli

    _, out, _ = llama_run
    code, stdout, _ = run_cli(capsys, "export", "--checkpoint", str(out), "--adapter", str(tmp_path / "a"),
                              "--hf", str(tmp_path / "m"), "--dtype", "bfloat16")
    assert code == 0 and stdout == f"wrote {tmp_path / 'm'}\nwrote {tmp_path / 'a'}\n"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert {f.get_tensor(k).dtype for k in names} == {torch.bfloat16} and len(names) == 2 * 4 * 2
    code, _, err = run_cli(capsys, "export", "--checkpoint", str(out))
    assert code == 2 and "give --hf OUT (the whole model), --adapter OUT (a peft adapter), --gguf OUT.gguf (for llama.cpp), or several" in err
    code, _, err = run_cli(capsys, "export", "--checkpoint", str(trained / "run"), "--adapter", str(tmp_path / "b"))
    assert code == 2 and err.startswith("ipuft: error: --adapter: checkpoint ") and err.count("\n") == 1
    assert "has no adapter (its model.adapter is null): export the whole model with --hf" in err
    assert not (tmp_path / "b").exists()
