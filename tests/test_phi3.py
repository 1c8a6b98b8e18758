"""Phi-3 and Phi-4 (``model_type`` ``phi3``) are transformers' Phi3ForCausalLM, on tiny random checkpoints that
transformers builds and saves: fused ``qkv_proj`` / ``gate_up_proj`` split at import and stacked at export bit
for bit, partial rotary and longrope (short and long factors), logits, loss, every gradient, eval loss, three
AdamW steps, LoRA against peft, and one line for a fused tensor of the wrong shape."""

import copy
import json

import pytest
import torch
from cli_helpers import run_cli as cli
from llama_reference import tokenizer_json
from safetensors.torch import load_file, save_file
from test_engine import max_rel
from test_llama import adam_config, assert_eval_loss_matches, hf_adam_steps
from test_parity_hf import ipuft_forward

from ipuft.attention import HalvesRotary
from ipuft.components import IGNORE_INDEX
from ipuft.config import load_config
from ipuft.engine.model import build_model
from ipuft.engine.variables import initial_values
from ipuft.errors import CheckpointError
from ipuft.io.hf_import import hf_initializer
from ipuft.io.hf_names import stack_rows, unit_fused, unit_mappings
from ipuft.run.export import export_hf
from ipuft.run.runtime import build_engine
from ipuft.run.train import train

# 6 query heads of width 8; a 101-token vocabulary whose pad (100) the random tokens never use (transformers
# gives the pad row no gradient, ipuft trains it from its uses: see ipuft_llama.phi3).
SHAPE = {"hidden_size": 48, "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 6,
         "vocab_size": 101, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "bos_token_id": 1,
         "eos_token_id": 2, "pad_token_id": 100, "tie_word_embeddings": False}
SHORT, LONG = [1.0, 1.3, 2.5, 4.0], [1.5, 3.0, 7.0, 16.0]
KINDS = {
    # Phi-3-mini-128k: whole heads turn, longrope with the long factors (16 tokens past an original 8), a window.
    "phi3-mini-128k": {"num_key_value_heads": 6, "original_max_position_embeddings": 8, "sliding_window": 32,
                       "rope_parameters": {"rope_type": "longrope", "rope_theta": 5000.0, "short_factor": SHORT,
                                           "long_factor": LONG}},
    # Phi-4-mini: 3 of 4 pairs turn (0.75), longrope with the short factors (16 tokens within 32), GQA, tied.
    "phi4-mini": {"num_key_value_heads": 2, "original_max_position_embeddings": 32, "tie_word_embeddings": True,
                  "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                      "short_factor": SHORT[:3], "long_factor": LONG[:3]}},
    # Phi-4: full rotary, no rope scaling, GQA, a larger vocabulary than Phi-3's (its 100352 here 131).
    "phi4": {"num_key_value_heads": 2, "vocab_size": 131, "rope_parameters": {"rope_type": "default",
                                                                              "rope_theta": 250000.0}},
}


def hf_model(kind: str, seed: int = 0, **extra):
    """transformers' Phi3ForCausalLM of ``kind``, random weights with non-trivial norms, in eval mode."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    model = Phi3ForCausalLM(Phi3Config(**copy.deepcopy({**SHAPE, **KINDS[kind], **extra}))).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    return model


def save_hf(directory, kind, seed=0, **extra):
    model = hf_model(kind, seed, **extra)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer_json(directory / "tokenizer.json", model.config.vocab_size)
    return model, directory


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3")
    return {kind: save_hf(root / kind, kind, seed=i) for i, kind in enumerate(KINDS)}


def config(hooks, src, *extra):
    return load_config(None, [f"model.hf_checkpoint={src}", "model.sequence_length=16", *extra],
                       hooks.registrations.config_sections)


def imported(parts, cfg):
    """Every unit's tensors as the import reads them from the checkpoint (the fused ones split), leaves."""
    initial = hf_initializer(cfg.model.hf_checkpoint, parts.modules, cfg.model.layers,
                             lambda unit, specs: initial_values(unit, specs, 0))
    units = {unit: {n: t.clone().requires_grad_() for n, t in initial(unit, parts.variables[unit.role]).items()}
             for unit in unit_mappings(parts.modules, cfg.model.layers)}
    if cfg.model.tie_embeddings:  # the head computes with the embeddings' table itself
        units["head"]["lm_head.weight"] = units["embeddings"]["embed_tokens.weight"]
    return units


def as_hf(parts, layers, units, grad=False):
    """The units' tensors (or their gradients) under Phi-3's names, the fused ones stacked."""
    named = {hf: (units[unit][local].grad if grad else units[unit][local])
             for unit, mapping in unit_mappings(parts.modules, layers).items() for local, hf in mapping.items()}
    for group in unit_fused(parts.modules, layers).values():
        for fused in group:
            named[fused.name] = stack_rows(fused, {p: named.pop(p) for p in fused.parts})
    return named


@pytest.mark.parametrize("kind", KINDS)
def test_config_json_sets_partial_rotary_longrope_and_fused_projections(hooks, hf_dirs, kind):
    """transformers 5's rope_parameters and the Hub's older rope_scaling (type "su", top-level rope_theta and
    partial_rotary_factor) read alike; the attention factor is computed from max/original positions."""
    from ipuft_llama.phi3 import read_config

    cfg = config(hooks, hf_dirs[kind][1])
    m, options = cfg.model, cfg.plugins.llama
    assert (m.family, m.decoder, options.fused_projections, m.tie_embeddings) == (
        "phi3", "llama", True, kind == "phi4-mini")
    assert (m.attention.rotary_dim, options.head_dim) == (6 if kind == "phi4-mini" else 8, 8)
    source = json.loads((hf_dirs[kind][1] / "config.json").read_text())
    if kind == "phi4":
        assert options.rope_scaling is None and m.embedding.vocab_size == 131
        return
    scaling = dict(options.rope_scaling)
    original = KINDS[kind]["original_max_position_embeddings"]
    assert scaling["attention_factor"] == pytest.approx((1 + torch.tensor(64 / original).log().item()
                                                         / torch.tensor(float(original)).log().item()) ** 0.5)
    assert scaling["original_max_position_embeddings"] == original
    assert len(scaling["short_factor"]) == len(scaling["long_factor"]) == m.attention.rotary_dim // 2
    params = KINDS[kind]["rope_parameters"]
    hub = {k: v for k, v in source.items() if k != "rope_parameters"}
    hub.update(rope_theta=params["rope_theta"], partial_rotary_factor=params.get("partial_rotary_factor", 1.0),
               rope_scaling={"type": "su", "short_factor": params["short_factor"],
                             "long_factor": params["long_factor"]})
    assert read_config(hub) == read_config(source)


def test_rotary_tables_equal_transformers_short_and_long():
    """HalvesRotary's longrope table, partial (6 of 8) and whole, equals Phi3RotaryEmbedding's cos and sin bit for
    bit: short factors up to the original context, long past it, the attention factor on both."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from ipuft_llama.phi3 import read_config

    for kind, rotary_dim in (("phi3-mini-128k", 8), ("phi4-mini", 6)):
        for length in (8, 40):
            hf_config = Phi3Config(**copy.deepcopy({**SHAPE, **KINDS[kind], "original_max_position_embeddings": 16}))
            cos, sin = Phi3RotaryEmbedding(hf_config)(torch.zeros(1), torch.arange(length)[None])
            settings = read_config(hf_config.to_dict())
            rotary = HalvesRotary(8, rotary_dim, hf_config.rope_parameters["rope_theta"],
                                  settings["plugins.llama.rope_scaling"], longest=length)
            ours = rotary.table(length, torch.device("cpu"))
            assert torch.equal(ours[0], cos[0]) and torch.equal(ours[1], sin[0]), (kind, length)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_loss_and_gradients_match_transformers(hooks, hf_dirs, kind):
    """From the import's own split of the checkpoint: logits, loss, and every gradient (the fused ones stacked
    from their parts') equal Phi3ForCausalLM's."""
    hf, src = hf_dirs[kind]
    cfg = config(hooks, src)
    parts = build_model(cfg, hooks)
    units = imported(parts, cfg)
    ids = torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(1))
    hf.zero_grad()
    hf_out = hf(ids, labels=ids)
    torch.testing.assert_close(ipuft_forward(parts, units, ids), hf_out.logits, atol=1e-5, rtol=0)
    labels = torch.cat([ids[:, 1:], torch.full((3, 1), IGNORE_INDEX)], dim=1)
    loss = ipuft_forward(parts, units, ids, labels)
    torch.testing.assert_close(loss, hf_out.loss, atol=1e-6, rtol=1e-6)
    hf_out.loss.backward()
    loss.backward()
    ours = as_hf(parts, 2, units, grad=True)
    hf_params = dict(hf.named_parameters())
    assert set(ours) == set(hf_params)
    for name, p in hf_params.items():
        torch.testing.assert_close(ours[name], p.grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["phi3-mini-128k", "phi4-mini"])
def test_import_train_at_lr_0_export_is_bit_exact_and_loads_in_transformers(hooks, hf_dirs, tmp_path, kind):
    import transformers

    hf, src = hf_dirs[kind]
    run = tmp_path / "run"
    train(config(hooks, src, "training.global_batch_size=2", "training.steps=2",
                 "training.optimizer.learning_rate.maximum=0.0", f"output_dir={run}"), hooks, progress=False)
    out = export_hf(run, tmp_path / "exported", hooks)
    exported, original = load_file(str(out / "model.safetensors")), load_file(str(src / "model.safetensors"))
    assert exported.keys() == original.keys()
    assert {"model.layers.1.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= exported.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert json.loads((out / "config.json").read_text())["model_type"] == "phi3"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)


def test_a_fused_tensor_of_the_wrong_shape_is_one_line(hooks, hf_dirs, tmp_path, capsys):
    import shutil

    _, src = hf_dirs["phi4"]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-8]  # one value head short
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    cfg = config(hooks, bad)
    parts = build_model(cfg, hooks)
    with pytest.raises(CheckpointError) as caught:
        imported(parts, cfg)
    assert str(caught.value) == (f"model.hf_checkpoint {bad}: {name} has shape (72, 48), the model expects (80, 48) "
                                 f"(q_proj 48 + k_proj 16 + v_proj 16 rows)")
    run = tmp_path / "run"
    code, out, err = cli(capsys, "train", "--config", "tiny", f"model.hf_checkpoint={bad}", "model.sequence_length=16",
                         "training.steps=1", f"output_dir={run}")
    assert (code, out) == (2, ""), err
    assert err == f"ipuft: error: {caught.value}\n"
    assert not run.exists()


def test_eval_loss_matches_transformers(capsys, hf_dirs, tmp_path):
    hf, src = hf_dirs["phi4-mini"]
    assert_eval_loss_matches(capsys, hf, src, tmp_path, vocab=100)


@pytest.mark.parametrize("kind", ["phi3-mini-128k", "phi4-mini"])
def test_three_adam_steps_equal_transformers_with_torch_adamw(hooks, hf_dirs, kind):
    """The phased engine against Phi3ForCausalLM and torch.optim.AdamW: three steps, losses, norms and every
    weight (the fused ones stacked) within 1e-5."""
    from transformers import Phi3ForCausalLM

    # A fresh copy (the fixture's model is shared). The synthetic batches hold the pad id, whose row both
    # transformers' embedding (padding_idx) and ipuft's (plugins.llama.padding_idx) give no gradient.
    hf = Phi3ForCausalLM.from_pretrained(hf_dirs[kind][1]).float().train(False)
    assert hf.model.embed_tokens.padding_idx is not None
    cfg = adam_config(hooks, hf_dirs[kind][1])
    engine = build_engine(cfg, hooks)
    for (loss, hf_loss), (norm, hf_norm) in hf_adam_steps(hf, cfg, engine):
        assert abs(loss - hf_loss) <= 1e-5 * abs(hf_loss)
        assert abs(norm - hf_norm) <= 1e-5 * hf_norm
    ours = as_hf(engine.model.parts if hasattr(engine.model, "parts") else build_model(cfg, hooks), 2,
                 engine.model.full_weights())
    worst = {name: max_rel(ours[name], p.detach()) for name, p in hf.named_parameters()}
    # Where a gradient nearly cancels (a tied table's two uses; q, k and v as three matmuls against one fused),
    # the sums' rounding differs, and Adam's m / (sqrt(v) + eps) makes more of a step of it (1.6e-5 measured).
    assert max(worst.values()) <= 3e-5, worst


def lora_config(hooks, src, *targets, steps=3, out=None):
    return config(hooks, src, "training.global_batch_size=4", "execution.micro_batch_size=2", f"training.steps={steps}",
                  "training.optimizer.learning_rate.maximum=2e-2", "training.optimizer.gradient_clipping=0.05",
                  "plugins.adamw.weight_decay=0.1", "plugins.adamw.eps=1e-5", "model.adapter=lora",
                  "plugins.lora.rank=4", "plugins.lora.alpha=8.0", f"plugins.lora.targets=[{','.join(targets)}]",
                  "execution.head_chunk_tokens=0", *([f"output_dir={out}"] if out else []))


def unfused_llama(phi3):
    """transformers' LlamaForCausalLM with ``phi3``'s weights, q/k/v and gate/up apart: the same model (full
    rotary, no longrope) with a module per projection, as ipuft holds it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = phi3.config
    llama = LlamaForCausalLM(LlamaConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_parameters["rope_theta"], tie_word_embeddings=False)).float().eval()
    state, q, kv = {}, c.num_attention_heads * 8, c.num_key_value_heads * 8
    for name, t in phi3.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            for p, piece in zip("qkv", t.split([q, kv, kv])):
                state[name.replace("qkv_proj", f"{p}_proj")] = piece
        elif name.endswith("gate_up_proj.weight"):
            for p, piece in zip(("gate", "up"), t.chunk(2)):
                state[name.replace("gate_up_proj", f"{p}_proj")] = piece
        else:
            state[name] = t
    llama.load_state_dict(state, strict=True)
    return llama


def test_lora_three_adamw_steps_equal_peft_with_torch_adamw(hooks, hf_dirs):
    """LoRA on every target of a Phi-4 (q, k, v apart though the checkpoint fuses them) equals peft's LoRA on
    the same model with a module per projection (Llama's), clipping and weight decay active: losses, norms and
    every adapter within 1e-5. (peft on Phi3ForCausalLM adapts qkv_proj as one module: the export writes ipuft's
    three adapters as that one, next test.)"""
    from peft import LoraConfig, get_peft_model
    from test_lora import peft_adam_steps

    hf, src = hf_dirs["phi4"]
    cfg = lora_config(hooks, src, "q", "k", "v", "o", "gate", "up", "down")
    engine = build_engine(cfg, hooks)
    names = {f"decoder.{n}": {f"{path}.{ab}": f"base_model.model.model.layers.{n}.{path}.{ab}.weight"
                              for path in engine.modules["decoder"].lora_paths for ab in ("lora_A", "lora_B")}
             for n in range(2)}

    def ours():
        weights = engine.model.full_weights()
        return {peft: weights[unit][local] for unit, m in names.items() for local, peft in m.items()}

    model = get_peft_model(unfused_llama(hf), LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    initial = ours()
    with torch.no_grad():  # ipuft's initial adapters (B zeros in both)
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(initial[name.replace(".default.", ".")])
    results = peft_adam_steps(model, cfg, engine)
    assert results[0][1][1] > 2 * cfg.training.optimizer.gradient_clipping  # clipping is active
    for (loss, peft_loss), (norm, peft_norm) in results:
        assert abs(loss - peft_loss) <= 1e-5 * abs(peft_loss)
        assert abs(norm - peft_norm) <= 1e-5 * peft_norm
    theirs = {n.replace(".default.", "."): p.detach() for n, p in model.named_parameters() if p.requires_grad}
    mine = ours()
    assert mine.keys() == theirs.keys() and len(mine) == 2 * 7 * 2
    for name, p in theirs.items():
        assert max_rel(mine[name], p) <= 1e-5, name


def test_lora_exports_load_in_peft_and_transformers_and_give_ipufts_logits(hooks, hf_dirs, tmp_path):
    """Phi-4-mini (longrope, partial rotary, tied) after LoRA steps on q, v (k not), o, gate, up and down: the
    peft export adapts qkv_proj and gate_up_proj as peft does, one adapter each of rank m · 4 (m the parts
    targeted; B block-diagonal, k's rows zero; alpha scaled alike), which peft loads onto Phi3ForCausalLM; it
    and the merged --hf export give ipuft's logits."""
    import transformers
    from peft import PeftModel
    from test_lora import eval_logits

    from ipuft.run.export import export_adapter

    _, src = hf_dirs["phi4-mini"]
    run = tmp_path / "run"
    targets = ("q", "v", "o", "gate", "up", "down")
    train(lora_config(hooks, src, *targets, steps=4, out=run), hooks, progress=False)
    adapter = export_adapter(run, tmp_path / "adapter", hooks)
    written = json.loads((adapter / "adapter_config.json").read_text())
    m = sum(t in targets for t in "qkv")
    assert written["rank_pattern"]["qkv_proj"] == 4 * m and written["alpha_pattern"]["qkv_proj"] == 8.0 * m
    assert written["target_modules"] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert written["rank_pattern"]["gate_up_proj"] == 8
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(4))
    ours = eval_logits(hooks, run, ids)
    with torch.no_grad():
        peft = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(src), adapter).eval()
        torch.testing.assert_close(peft(input_ids=ids).logits, ours, atol=1e-5, rtol=0)
        merged = transformers.AutoModelForCausalLM.from_pretrained(export_hf(run, tmp_path / "merged", hooks)).eval()
        torch.testing.assert_close(merged(ids).logits, ours, atol=1e-5, rtol=0)
        base = transformers.AutoModelForCausalLM.from_pretrained(src)(ids).logits
    assert (ours - base).abs().max() > 1e-3  # the adapters moved the model


@pytest.mark.parametrize("kind", ["phi3-mini-128k", "phi4-mini"])
def test_a_config_json_written_from_scratch_reads_back_and_builds_phi3_in_transformers(hooks, hf_dirs, kind):
    """Without a source config.json (a model from scratch), the family's own: transformers' Phi3Config reads it
    to the same rotary (partial, longrope factors, attention factor) and ipuft reads it back to the same keys."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from ipuft_llama.phi3 import FAMILY, read_config

    hf, src = hf_dirs[kind]
    cfg = config(hooks, src)
    written = FAMILY.write_config(cfg)
    source = read_config(json.loads((src / "config.json").read_text()))
    assert read_config(written) == source
    theirs = Phi3Config(**copy.deepcopy(written))
    positions = torch.arange(16)[None]
    for a, b in zip(Phi3RotaryEmbedding(theirs)(torch.zeros(1), positions),
                    hf.model.rotary_emb(torch.zeros(1), positions), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("change", "message"), [
    ({"resid_pdrop": 0.1}, "resid_pdrop=0.1: ipuft runs Phi-3 with resid_pdrop null, 0, 0.0 only"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0, 2.0, 3.0, 4.0]}},
     "rope_parameters's short_factor must be a list of 4 positive numbers (one per rotated pair of "
     "partial_rotary_factor · head_dim dimensions), got a list ([1.0])"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.1}}, "partial_rotary_factor=0.1 turns 0 of "
     "head_dim=8 dimensions; rotary needs an even number of at least 2"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_parameters's rope_type 'dynamic': Phi-3 runs default or longrope"),
])
def test_a_phi3_config_json_it_cannot_run_is_one_line(hf_dirs, change, message):
    from ipuft.families import HFConfigError
    from ipuft_llama.phi3 import read_config

    source = json.loads((hf_dirs["phi3-mini-128k"][1] / "config.json").read_text())
    with pytest.raises(HFConfigError) as caught:
        read_config({**source, **change})
    assert str(caught.value) == message


def test_tensor_and_data_parallel_training_equal_one_process(hooks, hf_dirs, tmp_path):
    """Phi-4-mini (fused in its checkpoint, split in the store; partial rotary, longrope, tied) at TP=2, five steps
    on two Gloo ranks: losses, norms and every weight equal one process, counters the plan."""
    from test_llama import equal_to_one_process

    src = hf_dirs["phi4-mini"][1]
    common = [f"model.hf_checkpoint={src}", "model.sequence_length=16", "execution.micro_batch_size=1",
              "training.steps=5", "training.optimizer.gradient_clipping=0.5",
              "training.optimizer.learning_rate.maximum=2e-3", "plugins.adamw.weight_decay=0.1", "plugins.adamw.eps=1e-4"]
    # TP is what the split variables meet (q/k/v column-sharded from a fused tensor); DP=2 with RTS passed too
    # (measured with this test), and is the Llama block's, tested in tests/test_llama.py.
    configs = {"phi_tp2": ["execution.tensor_parallel=2", "training.global_batch_size=2", *common]}
    for name, (results, got) in equal_to_one_process(hooks, configs, 5, tmp_path).items():
        assert results[0].grad_norm > 0.5, name  # clipping is active
        assert "self_attn.q_proj.weight" in got["weights"]["decoder.0"], name


@pytest.mark.parametrize("kind", KINDS)
def test_ipuft_plan_is_what_training_moves_and_holds(capsys, hooks, hf_dirs, kind):
    """The checkpoint's fused projections planned as the engine stores and moves them, split."""
    from test_families import plan_is_what_training_moves_and_holds

    plan_is_what_training_moves_and_holds(capsys, hooks, *hf_dirs[kind])
