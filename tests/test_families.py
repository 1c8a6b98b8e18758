"""The families described as data beside Llama (``ipuft_llama.description``): Qwen3, OLMo 2, Gemma 2 and Gemma 3
against transformers' own classes, on tiny random checkpoints of odd shapes (6 query heads of 16 over 2
key/value heads, a 101-token vocabulary, every norm perturbed; tests/llama_reference.py says what each has made
to matter): logits, loss and every gradient, eval loss, three AdamW steps, a bit-exact import → train(lr=0) →
export that transformers reloads, a config.json from scratch that transformers reads as the same model, and a
family made from a description alone, held against a plain reference written here."""

import json

import pytest
import torch
import torch.nn.functional as F
from hf_reference import hf_state, hf_units
from llama_reference import hf_model, save_hf, tokenizer_json
from safetensors.torch import load_file, save_file
from test_engine import max_rel
from test_llama import adam_config, config, export_after_lr_0, hf_adam_steps
from torch.func import functional_call

from ipuft import hookimpl
from ipuft.attention import decoder_layer
from ipuft.components import IGNORE_INDEX
from ipuft.engine.model import build_model
from ipuft.io.hf_export import hf_config
from ipuft.plugins import create_plugin_manager
from ipuft.run.runtime import build_engine

FAMILIES = ["qwen3", "olmo2", "gemma2", "gemma3_text"]
# Three AdamW steps' weights against transformers + torch.optim.AdamW, relative to each tensor's largest: float32
# rounding in the gradients (1e-7 relative) is turned by Adam's normalisation into steps of up to lr·O(1) on
# elements whose gradient is about nothing, and q/k norms make such elements (the directions a norm ignores):
# 2e-5 measured on Qwen3's q_proj and embeddings at lr 1e-3, where Llama's stay within 4e-6.
ADAM_WEIGHTS = 5e-5


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Each family's random model, saved as a Hugging Face directory with a word-level tokenizer."""
    root = tmp_path_factory.mktemp("families")
    return {kind: save_hf(root / kind, kind, seed=10 + i) for i, kind in enumerate(FAMILIES)}


def layered_forward(parts, units, ids, labels=None):
    """The model of ``parts`` on ``units``' tensors, each decoder call within its layer's context (the engine's
    :func:`ipuft.attention.decoder_layer`), as the engine runs it: logits, or the loss with ``labels``."""
    if "lm_head.weight" not in units["head"]:  # tied: the head computes with the embeddings' table
        units = {**units, "head": {**units["head"], "lm_head.weight": units["embeddings"]["embed_tokens.weight"]}}
    h = functional_call(parts.modules["embeddings"], units["embeddings"], (ids,))
    for n in range(parts.program.layers):
        with decoder_layer(n):
            h = functional_call(parts.modules["decoder"], units[f"decoder.{n}"], (h,))
    return functional_call(parts.modules["head"], units["head"], (h,) if labels is None else (h, labels))


def match_transformers(hooks, hf, src, *extra):
    """ipuft's model of ``src`` computes transformers' ``hf``: logits, loss and every gradient on random tokens
    (16 of them, past every window); the largest differences."""
    cfg = config(hooks, src, *extra)
    parts = build_model(cfg, hooks)
    units = hf_units(parts.modules, cfg.model.layers,
                     {k: v.detach().clone().requires_grad_() for k, v in hf.state_dict().items()})
    ids = torch.randint(0, 101, (3, 16), generator=torch.Generator().manual_seed(1))
    hf.zero_grad()
    hf_out = hf(ids, labels=ids)
    logits = layered_forward(parts, units, ids)
    torch.testing.assert_close(logits, hf_out.logits, atol=1e-5, rtol=0)
    labels = torch.cat([ids[:, 1:], torch.full((3, 1), IGNORE_INDEX)], dim=1)  # ipuft's labels come shifted
    loss = layered_forward(parts, units, ids, labels)
    torch.testing.assert_close(loss, hf_out.loss, atol=1e-6, rtol=1e-6)
    hf_out.loss.backward()
    loss.backward()
    ours = hf_state(parts.modules, cfg.model.layers, units)
    hf_params = dict(hf.named_parameters())
    assert set(ours) == set(hf_params)
    worst = 0.0
    for name, p in hf_params.items():
        torch.testing.assert_close(ours[name].grad, p.grad, atol=1e-5, rtol=1e-5, msg=name)
        worst = max(worst, (ours[name].grad - p.grad).abs().max().item())
    print(f"logits {(logits - hf_out.logits).abs().max().item():.1e}, gradients {worst:.1e}")


# Each family's block as its config.json sets it: (norms, norm_offset, norm_gain_float32, qk_norm, embedding_scale,
# activation, query_pre_attn_scalar, attn_logit_softcap, final_logit_softcap, layer_types, sliding_window,
# local_rope_theta).
SLIDING_FULL = ["sliding_attention", "full_attention"]
BLOCKS = {"qwen3": ("pre", False, False, "head", False, "silu", None, None, None, None, None, None),
          "olmo2": ("post", False, True, "width", False, "silu", None, None, None, None, None, None),
          "gemma2": ("sandwich", True, True, None, True, "gelu_pytorch_tanh", 12, 1.5, 3.0, SLIDING_FULL, 5, None),
          "gemma3_text": ("sandwich", True, True, "head", True, "gelu_pytorch_tanh", 12, None, None, SLIDING_FULL, 5,
                          100.0)}
BLOCK_KEYS = ("norms", "norm_offset", "norm_gain_float32", "qk_norm", "embedding_scale", "activation",
              "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "layer_types", "sliding_window",
              "local_rope_theta")


@pytest.mark.parametrize("kind", FAMILIES)
def test_each_config_json_sets_the_familys_block(hooks, hf_dirs, kind):
    """What each family's config.json says, read into plugins.llama (the description's fixed options and the
    checkpoint's own)."""
    o = config(hooks, hf_dirs[kind][1]).plugins.llama
    got = tuple(list(o[k]) if k == "layer_types" and o[k] is not None else o[k] for k in BLOCK_KEYS)
    assert got == BLOCKS[kind]
    assert (o.head_dim, o.kv_heads, o.padding_idx) == (16, 2, None if kind == "qwen3" else {"olmo2": 1}.get(kind, 0))
    if kind == "gemma3_text":  # linear rope scaling on the global layers
        assert (o.rope_scaling.rope_type, o.rope_scaling.factor) == ("linear", 4.0)


@pytest.mark.parametrize("kind", FAMILIES)
def test_logits_loss_and_gradients_match_transformers(hooks, hf_dirs, kind):
    match_transformers(hooks, *hf_dirs[kind])


@pytest.mark.parametrize("kind", ["qwen3", "olmo2", "gemma3_text"])
def test_untied_and_biased_variants_match_transformers(hooks, tmp_path, kind):
    """The other head (Gemma tied by default: untied; the others tied) and attention biases on q, k, v and o
    (``attention_bias``, perturbed), and Qwen3's sliding layers from max_window_layers on."""
    extra = {"tie_word_embeddings": kind != "gemma3_text", "attention_bias": True}
    if kind == "qwen3":
        extra.update(use_sliding_window=True, sliding_window=5, max_window_layers=1)
    hf, src = save_hf(tmp_path / kind, kind, seed=21, **extra)
    assert hf.config.tie_word_embeddings == extra["tie_word_embeddings"]
    match_transformers(hooks, hf, src)


@pytest.mark.parametrize("kind", FAMILIES)
def test_eval_loss_and_three_adamw_steps_equal_transformers(capsys, hooks, hf_dirs, tmp_path, kind):
    """Eval from the checkpoint's directory; then the phased engine (offloaded, recomputing, GA=2) against
    transformers' model and torch.optim.AdamW: losses, norms and every weight within 1e-5."""
    from cli_helpers import run_cli

    hf, src = hf_dirs[kind]
    rows = torch.randint(0, 101, (5, 17), generator=torch.Generator().manual_seed(0))
    data = tmp_path / "tokens.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r.tolist()}) + "\n" for r in rows))
    code, out, err = run_cli(capsys, "eval", f"model.hf_checkpoint={src}", "model.sequence_length=16",
                             f"data.path={data}", "data.format=tokens", "execution.micro_batch_size=2",
                             "model.precision=float32", "--json")
    assert code == 0, err
    with torch.no_grad():
        expected = F.cross_entropy(hf(rows[:, :-1]).logits.flatten(0, 1), rows[:, 1:].flatten()).item()
    assert abs(json.loads(out)["loss"] - expected) <= 1e-5

    fresh = hf_model(kind, seed=10 + FAMILIES.index(kind))  # the fixture's model is shared
    cfg = adam_config(hooks, src)
    engine = build_engine(cfg, hooks)
    for (loss, hf_loss), (norm, hf_norm) in hf_adam_steps(fresh, cfg, engine):
        assert abs(loss - hf_loss) <= 1e-5 * abs(hf_loss)
        assert abs(norm - hf_norm) <= 1e-5 * hf_norm
    ours = hf_state(engine.modules, 2, engine.model.full_weights())
    worst = max(max_rel(ours[name], p.detach()) for name, p in fresh.named_parameters())
    print(f"weights within {worst:.1e}")
    assert worst <= ADAM_WEIGHTS


@pytest.mark.parametrize("kind", FAMILIES)
def test_import_train_at_lr_0_export_is_bit_exact_and_loads_in_transformers(hooks, hf_dirs, tmp_path, kind):
    import transformers

    hf, src = hf_dirs[kind]
    out = export_after_lr_0(hooks, src, tmp_path)
    exported, original = load_file(str(out / "model.safetensors")), hf.state_dict()
    if hf.config.tie_word_embeddings:  # transformers' state dict lists the tied head, its file does not
        original = {k: v for k, v in original.items() if k != "lm_head.weight"}
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert json.loads((out / "config.json").read_text()) == {**json.loads((src / "config.json").read_text()),
                                                             "dtype": "float32"}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf)
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)


@pytest.mark.parametrize("kind", FAMILIES)
def test_ipuft_plan_of_each_family_is_what_its_training_moves_and_holds(capsys, hooks, hf_dirs, kind):
    plan_is_what_training_moves_and_holds(capsys, hooks, *hf_dirs[kind])


def plan_is_what_training_moves_and_holds(capsys, hooks, hf, src):
    """``ipuft plan`` of a family's checkpoint, in bfloat16 with stochastic rounding and offload: its
    parameters are transformers' (a tied table counted once), and two steps of the engine move exactly the
    planned bytes, store the planned host bytes and stay within the planned device peak."""
    from cli_helpers import run_cli

    from ipuft.data.tokens import data_source
    from ipuft.run.schedule import learning_rate
    from ipuft.run.train import replica_batch

    overrides = [f"model.hf_checkpoint={src}", "model.sequence_length=16", "model.precision=bfloat16",
                 "training.stochastic_rounding=true", "training.global_batch_size=4", "execution.micro_batch_size=2",
                 "execution.offload=true"]
    code, out, err = run_cli(capsys, "plan", "--json", *overrides)
    assert code == 0, err
    planned = json.loads(out)
    assert planned["parameters"] == hf.num_parameters()
    cfg = config(hooks, src, *overrides[2:])
    engine = build_engine(cfg, hooks)
    data = data_source(cfg)
    results = [engine.step(replica_batch(cfg, data, s, engine.layout),
                           learning_rate(s, 2, cfg.training.optimizer.learning_rate)) for s in range(2)]
    for result in results:
        assert result.traffic == planned["traffic"]
        assert 0 < result.device_peak_bytes <= planned["device_peak_bytes"]
    assert engine.store.host_bytes() == planned["host_bytes"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_config_json_from_scratch_is_read_as_the_same_model(hooks, hf_dirs, kind):
    """Without a source config.json (a model from scratch), the family writes one field by field: the family
    reads it back as the same ipuft keys, and transformers builds from it a model that, with the checkpoint's
    weights, computes the same logits."""
    import transformers

    hf, src = hf_dirs[kind]
    cfg = config(hooks, src)
    family = hooks.registrations.families.get(kind)
    written = hf_config(cfg, family, None)
    source = json.loads((src / "config.json").read_text())
    assert family.read_config(written) == family.read_config(source)
    theirs = transformers.AutoConfig.for_model(**{k: v for k, v in written.items() if k != "architectures"})
    rebuilt = transformers.AutoModelForCausalLM.from_config(theirs).float().eval()
    rebuilt.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(rebuilt(ids).logits, hf(ids).logits)


def test_config_json_of_the_hub_and_of_transformers_5_read_alike(hooks):
    """Gemma 3's rotaries as a Hub config.json gives them (rope_theta, rope_local_base_freq, the global layers'
    rope_scaling, sliding_window_pattern) and as transformers 5 writes them (rope_parameters per layer type,
    layer_types): the same keys."""
    from ipuft_llama.family import read_config

    shape = {"hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 6, "num_attention_heads": 8,
             "vocab_size": 101}
    hub = {**shape, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window": 512,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 3}
    written = {**shape, "sliding_window": 512, "layer_types": ["sliding_attention"] * 2 + ["full_attention"] +
               ["sliding_attention"] * 2 + ["full_attention"],
               "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    assert read_config(hub, "gemma3_text") == read_config(written, "gemma3_text")
    got = read_config(hub, "gemma3_text")
    assert got["plugins.llama.local_rope_theta"] == 1e4 and got["plugins.llama.rope_scaling"]["factor"] == 8.0
    assert got["plugins.llama.kv_heads"] == 4 and got["plugins.llama.head_dim"] == 256  # Gemma3TextConfig's


# ---- a family from a description alone ----

VARIANT = {"hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 37, "rms_norm_eps": 1e-5, "rope_theta": 500.0,
           "tie_word_embeddings": False, "model_type": "postqk", "bos_token_id": 1, "eos_token_id": 2}


def _rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def plain_postqk(w: dict, ids: torch.Tensor) -> torch.Tensor:
    """The variant's logits, written out: post-norms after attention and MLP, an RMSNorm over each q and k head
    before a rotate-half rotary, grouped-query causal attention, SwiGLU."""
    c, t = VARIANT, ids.shape[1]
    heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    inv = 1.0 / c["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    angles = torch.outer(torch.arange(t).float(), inv).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()

    def rotate(x):  # [B, h, T, d]
        return x * cos + torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1) * sin

    x = w["model.embed_tokens.weight"][ids]
    for n in range(c["num_hidden_layers"]):
        p = {k.removeprefix(f"model.layers.{n}."): v for k, v in w.items() if k.startswith(f"model.layers.{n}.")}
        q = _rms((x @ p["self_attn.q_proj.weight"].T).unflatten(-1, (heads, d)), p["self_attn.q_norm.weight"])
        k = _rms((x @ p["self_attn.k_proj.weight"].T).unflatten(-1, (kv, d)), p["self_attn.k_norm.weight"])
        v = (x @ p["self_attn.v_proj.weight"].T).unflatten(-1, (kv, d))
        q, k, v = rotate(q.transpose(1, 2)), rotate(k.transpose(1, 2)), v.transpose(1, 2)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = (q @ k.transpose(-1, -2)) / d**0.5
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(1, 2).flatten(-2) @ p["self_attn.o_proj.weight"].T
        x = x + _rms(attn, p["post_attention_layernorm.weight"])
        gate, up = x @ p["mlp.gate_proj.weight"].T, x @ p["mlp.up_proj.weight"].T
        x = x + _rms((F.silu(gate) * up) @ p["mlp.down_proj.weight"].T, p["post_feedforward_layernorm.weight"])
    return _rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_a_new_family_is_a_description_alone(tmp_path):
    """A family no plugin ships, registered here from a Description (post-norms, q/k norm per head, no edit
    outside this test): a checkpoint of it imports by its config.json, its weights' names are the ones the
    description implies, and its logits equal the plain reference's."""
    from ipuft.config import load_config
    from ipuft_llama.description import Description
    from ipuft_llama.family import family, parameter_names

    class Variant:
        @hookimpl
        def ipuft_register_model_families(self, registry):
            registry.add(family(Description("postqk", "Post-QK", "PostQKForCausalLM", norms="post",
                                            qk_norm="head", attention_bias="none")))

    hooks = create_plugin_manager(extra_plugins=[("postqk", Variant())])
    src = tmp_path / "postqk"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(VARIANT))
    tokenizer_json(src / "tokenizer.json", vocab_size=37)
    cfg = load_config(None, [f"model.hf_checkpoint={src}", "model.sequence_length=12"],
                      hooks.registrations.config_sections)
    generator = torch.Generator().manual_seed(4)
    weights = {}
    for name in sorted(parameter_names(cfg)):
        shape = build_shapes(cfg, hooks)[name]
        weights[name] = (1.0 + 0.1 * torch.randn(shape, generator=generator)) if "norm" in name \
            else 0.2 * torch.randn(shape, generator=generator)
    save_file(weights, str(src / "model.safetensors"))
    assert cfg.model.family == "postqk" and cfg.plugins.llama.norms == "post"
    parts = build_model(cfg, hooks)
    units = hf_units(parts.modules, 2, weights)
    ids = torch.randint(0, 37, (2, 12), generator=generator)
    with torch.no_grad():
        torch.testing.assert_close(layered_forward(parts, units, ids), plain_postqk(weights, ids), atol=1e-5,
                                   rtol=0)


def build_shapes(cfg, hooks) -> dict:
    """Each Hugging Face name's shape in ``cfg``'s model."""
    from ipuft.io.hf_names import unit_mappings

    parts = build_model(cfg, hooks)
    shapes = {unit: {s.name: s.shape for s in parts.modules[unit.split(".")[0]].variable_specs()}
              for unit in unit_mappings(parts.modules, cfg.model.layers)}
    return {hf: shapes[unit][local] for unit, mapping in unit_mappings(parts.modules, cfg.model.layers).items()
            for local, hf in mapping.items()}


# ---- sliding windows past the sequence: training, packed rows, generation ----

WINDOWED = {"mistral": {"sliding_window": 5},
            "qwen2": {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}}


@pytest.mark.parametrize("kind", list(WINDOWED))
def test_mistral_and_qwen2_windows_past_the_sequence_match_transformers(hooks, tmp_path, kind):
    """A 5-token window on 16-token rows: Mistral's on every layer, Qwen2's from max_window_layers (1) on, as
    transformers applies them; logits, loss and every gradient."""
    hf, src = save_hf(tmp_path / kind, kind, seed=30, **WINDOWED[kind])
    cfg = config(hooks, src)
    assert cfg.plugins.llama.sliding_window == 5
    assert cfg.plugins.llama.layer_types == (None if kind == "mistral" else ["full_attention", "sliding_attention"])
    match_transformers(hooks, hf, src)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3_text"])
def test_packed_rows_past_the_window_train_as_the_examples_one_per_row(hooks, tmp_path, kind):
    """Rows packing examples of 2 to 16 tokens (most longer than the 5-token window) keep each example apart
    and windowed: the loss, the gradient norm and every gradient of one step equal those of the examples one
    per row, which equal transformers' (above)."""
    from test_packed_attention import assert_same_step, first_step, one_per_row, packed_batch

    extra = {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1} if kind == "qwen3" else {}
    _, src = save_hf(tmp_path / kind, kind, seed=31, **extra)

    def rows(n):
        return config(hooks, src, f"execution.micro_batch_size={n}", f"training.global_batch_size={2 * n}")

    reference = first_step(rows(5), hooks, one_per_row(101))
    assert_same_step(first_step(rows(2), hooks, packed_batch(101)), reference, 1e-5)


def test_greedy_generation_past_the_window_equals_transformers(capsys, hf_dirs):
    """Gemma 3 from its directory: a 4-token prompt and 14 new tokens, well past the 5-token window of its
    sliding layer (whose cache keeps only the window), decoded greedily as transformers' generate does."""
    from cli_helpers import run_cli

    from ipuft.data.tokenizer import load_tokenizer

    hf, src = hf_dirs["gemma3_text"]
    prompt = "w5 w17 w9 w40"
    code, out, err = run_cli(capsys, "generate", "--checkpoint", str(src), "--max-new-tokens", "14", prompt)
    assert code == 0, err
    ids = torch.tensor([[5, 17, 9, 40]])
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=14, do_sample=False,
                             eos_token_id=2, pad_token_id=0)
    new = theirs[0, 4:].tolist()
    if 2 in new:
        new = new[: new.index(2) + 1]
    assert len(new) > 5  # past the window
    assert out == prompt + load_tokenizer(str(src)).decode(new, skip_special_tokens=False) + "\n"


def test_tensor_and_data_parallel_training_equal_one_process(hooks, tmp_path):
    """Gemma 3 (per-head q/k norms whose gradients are summed over TP, its window and local rotary, tied and
    vocabulary-sharded) and Qwen3 with sliding layers, each five steps on two Gloo ranks at TP=2 and at DP=2
    with RTS, from a checkpoint, against one process: losses, norms, every weight within 1e-5, and every
    rank's counters and store equal its plan."""
    from test_llama import equal_to_one_process

    dirs = {"gemma3": save_hf(tmp_path / "gemma3", "gemma3_text", seed=40)[1],
            "qwen3": save_hf(tmp_path / "qwen3", "qwen3", seed=41, use_sliding_window=True, sliding_window=5,
                             max_window_layers=1)[1]}
    common = ["model.sequence_length=16", "execution.micro_batch_size=1", "training.steps=5",
              "training.optimizer.gradient_clipping=0.5", "training.optimizer.learning_rate.maximum=2e-3",
              "plugins.adamw.weight_decay=0.1", "plugins.adamw.eps=1e-4"]
    configs = {}
    for name, src in dirs.items():
        configs[f"tp2_{name}"] = [f"model.hf_checkpoint={src}", "execution.tensor_parallel=2",
                                  "training.global_batch_size=2", *common]
        configs[f"dp2_{name}"] = [f"model.hf_checkpoint={src}", "execution.data_parallel=2", "execution.rts=true",
                                  "training.global_batch_size=4", *common]
    for results, _ in equal_to_one_process(hooks, configs, 5, tmp_path).values():
        assert results[0].grad_norm > 0.5  # clipping is active


# Gemma 3 12B's config.json (google/gemma-3-12b-it's text_config, as the Hub's config.json gives it).
GEMMA3_12B = {"model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 262208,
              "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 1024,
              "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
              "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False,
              "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": [1, 106], "tie_word_embeddings": True,
              "max_position_embeddings": 131072}


def test_the_gemma3_12b_preset_is_gemma_3_12b(capsys, hooks):
    """The preset's shapes are the checkpoint's: the family reads Gemma 3 12B's config.json as the preset's
    keys (none differs), and ipuft plan counts the parameters transformers' Gemma3ForCausalLM has at that
    config (built on the meta device: 11,766,034,176)."""
    import transformers
    from cli_helpers import run_cli

    from ipuft.config import load_config
    from ipuft.io.hf_export import source_mismatches

    cfg = load_config("gemma3-12b", sections=hooks.registrations.config_sections)
    assert source_mismatches(cfg, hooks.registrations.families.get("gemma3_text"), GEMMA3_12B) == []
    theirs = transformers.AutoConfig.for_model(**GEMMA3_12B)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(theirs)
    count = sum(p.numel() for p in model.parameters())
    code, out, err = run_cli(capsys, "plan", "--config", "gemma3-12b", "--json")
    assert code == 0, err
    assert json.loads(out)["parameters"] == count == 11_766_034_176
