"""The Llama-architecture plugin (``ipuft-llama``) is transformers' LlamaForCausalLM, Qwen2ForCausalLM and
MistralForCausalLM, on random checkpoints of odd shapes (6 query heads over 2 key/value heads, a 101-token
vocabulary, Llama 3.1's rope scaling, Qwen2's q/k/v biases): logits, loss, every gradient, eval loss, three
Adam steps, parallel layouts, a bit-exact import → train(lr=0) → export, generation's special tokens, and one
line for each config.json it cannot run."""

import json
import shutil
from pathlib import Path

import dist_workers
import pytest
import torch
import torch.nn.functional as F
from cli_helpers import run_cli as cli
from cli_helpers import without_recipe
from distributed import spawn
from hf_reference import hf_state, hf_units
from llama_reference import hf_model, save_hf
from safetensors.torch import load_file
from test_engine import max_rel
from test_parity_hf import ipuft_forward

from ipuft.components import IGNORE_INDEX
from ipuft.config import load_config
from ipuft.data.tokens import data_source
from ipuft.engine.model import build_model
from ipuft.errors import CheckpointError
from ipuft.io.checkpoint import find_checkpoint
from ipuft.plan.estimate import estimate
from ipuft.run.export import export_hf
from ipuft.run.runtime import build_engine
from ipuft.run.schedule import learning_rate
from ipuft.run.train import replica_batch, train

KINDS = ["llama", "qwen2", "mistral"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Each kind's random model, saved as a Hugging Face directory with a word-level tokenizer."""
    root = tmp_path_factory.mktemp("llama-family")
    return {kind: save_hf(root / kind, kind, seed=i) for i, kind in enumerate(KINDS)}


def config(hooks, src, *extra):
    return load_config(None, [f"model.hf_checkpoint={src}", "model.sequence_length=16", *extra],
                       hooks.registrations.config_sections)


@pytest.mark.parametrize("kind", KINDS)
def test_config_json_sets_the_family_components_and_shapes(hooks, hf_dirs, kind):
    cfg = config(hooks, hf_dirs[kind][1])
    m, options = cfg.model, cfg.plugins.llama
    assert (m.family, m.embeddings, m.decoder, m.head) == (kind, "llama", "llama", "llama")
    assert (m.layers, m.hidden_size, m.intermediate_size, m.attention.heads, m.embedding.vocab_size) == (2, 48, 80, 6, 101)
    assert (options.kv_heads, options.head_dim, m.attention.rotary_dim) == (2, 8, 8)
    assert (options.qkv_bias, options.output_bias) == ((True, False) if kind == "qwen2" else (False, False))
    assert (m.bos_token_id, list(m.eos_token_ids)) == (1, [2])
    assert m.layer_norm_epsilon == 1e-5
    if kind == "llama":
        assert m.attention.rotary_positional_embeddings_base == 5000.0
        assert {k: v for k, v in dict(options.rope_scaling).items() if v is not None} == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    if kind == "mistral":
        assert options.sliding_window == 32


@pytest.mark.parametrize("kind", KINDS)
def test_logits_loss_and_gradients_match_transformers(hooks, hf_dirs, kind):
    match_transformers(hooks, *hf_dirs[kind])


def match_transformers(hooks, hf, src):
    """ipuft's model of directory ``src`` computes transformers' ``hf``: logits, loss and every gradient on
    random tokens; returns the run's config."""
    cfg = config(hooks, src)
    parts = build_model(cfg, hooks)
    units = hf_units(parts.modules, 2, {k: v.detach().clone().requires_grad_() for k, v in hf.state_dict().items()})
    ids = torch.randint(0, 101, (3, 16), generator=torch.Generator().manual_seed(1))
    hf.zero_grad()
    hf_out = hf(ids, labels=ids)
    torch.testing.assert_close(ipuft_forward(parts, units, ids), hf_out.logits, atol=1e-5, rtol=0)
    labels = torch.cat([ids[:, 1:], torch.full((3, 1), IGNORE_INDEX)], dim=1)  # ipuft's labels come shifted
    loss = ipuft_forward(parts, units, ids, labels)
    torch.testing.assert_close(loss, hf_out.loss, atol=1e-6, rtol=1e-6)
    hf_out.loss.backward()
    loss.backward()
    ours = hf_state(parts.modules, 2, units)
    hf_params = dict(hf.named_parameters())
    assert set(ours) == set(hf_params)
    for name, p in hf_params.items():
        torch.testing.assert_close(ours[name].grad, p.grad, atol=1e-5, rtol=1e-5, msg=name)
    return cfg


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_eval_loss_matches_transformers(capsys, hf_dirs, tmp_path, tied):
    """Eval loss from the checkpoint's directory; a tied one's head computes with the embeddings' table."""
    hf, src = save_hf(tmp_path / "tied", "llama", seed=5, tie_word_embeddings=True) if tied else hf_dirs["llama"]
    assert_eval_loss_matches(capsys, hf, src, tmp_path, vocab=101)


def assert_eval_loss_matches(capsys, hf, src, tmp_path, vocab: int) -> None:
    """``ipuft eval`` of ``src`` on five random token rows equals ``hf``'s cross-entropy within 1e-5."""
    rows = torch.randint(0, vocab, (5, 17), generator=torch.Generator().manual_seed(0))
    data = tmp_path / "tokens.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r.tolist()}) + "\n" for r in rows))
    code, out, err = cli(capsys, "eval", f"model.hf_checkpoint={src}", "model.sequence_length=16", f"data.path={data}",
                         "data.format=tokens", "execution.micro_batch_size=2", "model.precision=float32", "--json")
    assert code == 0, err
    with torch.no_grad():
        logits = hf(rows[:, :-1]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()
    assert abs(json.loads(out)["loss"] - expected) <= 1e-5


def adam_config(hooks, src, *extra, lr=1e-3, steps=3):
    """Three steps at ``lr`` without weight decay or clipping, GA=2: what :func:`hf_adam_steps` compares."""
    return config(hooks, src, "training.global_batch_size=4", "execution.micro_batch_size=2",
                  f"training.steps={steps}", f"training.optimizer.learning_rate.maximum={lr}",
                  "training.optimizer.gradient_clipping=1e9", "plugins.adamw.weight_decay=0.0",
                  "plugins.adamw.eps=1e-6", *extra)


def hf_adam_steps(hf, cfg, engine, lr=1e-3):
    """``cfg``'s steps of the phased ``engine`` and of transformers' ``hf`` with torch.optim.AdamW on the same
    batches; per step, the engine's and the reference's (loss, global gradient norm)."""
    steps = cfg.training.steps
    data = data_source(cfg)
    adam = torch.optim.AdamW(hf.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0)
    out = []
    for step in range(steps):
        batch = replica_batch(cfg, data, step, engine.layout)
        result = engine.step(batch, learning_rate(step, steps, cfg.training.optimizer.learning_rate))
        adam.zero_grad()
        losses = []
        for mb in range(batch.micro_batches):
            logits = hf(batch.input_ids[mb]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), batch.labels[mb].flatten(), ignore_index=IGNORE_INDEX)
            (loss / batch.micro_batches).backward()
            losses.append(loss.item())
        norm = torch.stack([p.grad.double().norm() for p in hf.parameters()]).norm().item()
        adam.step()
        out.append(((result.loss, sum(losses) / len(losses)), (result.grad_norm, norm)))
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_three_adam_steps_equal_transformers_with_torch_adamw(hooks, hf_dirs, kind):
    """The phased engine (offloaded, recomputing, GA=2) against transformers' model and torch.optim.AdamW:
    three steps from the same checkpoint, losses, norms and every weight within 1e-5."""
    hf = hf_model(kind, seed=KINDS.index(kind))  # a fresh copy: the fixture's model is shared
    cfg = adam_config(hooks, hf_dirs[kind][1])
    engine = build_engine(cfg, hooks)
    for (loss, hf_loss), (norm, hf_norm) in hf_adam_steps(hf, cfg, engine):
        assert abs(loss - hf_loss) <= 1e-5 * abs(hf_loss)
        assert abs(norm - hf_norm) <= 1e-5 * hf_norm
    ours = hf_state(engine.modules, 2, engine.model.full_weights())
    for name, p in hf.named_parameters():
        assert max_rel(ours[name], p.detach()) <= 1e-5, name


def test_tensor_and_data_parallel_training_equal_one_process(hooks, tmp_path):
    """TP=2 with the key/value heads split (2 of them) and replicated (3: TP does not divide them), Qwen2's
    biases at TP=2, and DP=2 with RTS, untied and tied, each five steps on two Gloo ranks from a checkpoint,
    against one process; every rank's counters and store equal its plan."""
    dirs = {kv: save_hf(tmp_path / f"kv{kv}", "llama", seed=7, num_key_value_heads=kv)[1] for kv in (2, 3)}
    qwen2 = save_hf(tmp_path / "qwen2", "qwen2", seed=8)[1]  # q/k/v biases split with their rows
    # Tied embeddings: both uses vocabulary-sharded alike at TP=2 (101 tokens, padded); under RTS the table, its
    # state and its one stored gradient sliced over DP.
    tied = {kind: save_hf(tmp_path / f"tied-{kind}", kind, seed=9, tie_word_embeddings=True)[1]
            for kind in ("llama", "qwen2")}
    common = ["model.sequence_length=16", "execution.micro_batch_size=1", "training.steps=5",
              "training.optimizer.gradient_clipping=0.5", "training.optimizer.learning_rate.maximum=2e-3",
              "plugins.adamw.weight_decay=0.1", "plugins.adamw.eps=1e-4"]
    configs = {"tp2_kv2": [f"model.hf_checkpoint={dirs[2]}", "execution.tensor_parallel=2",
                           "training.global_batch_size=2", *common],
               "tp2_kv3": [f"model.hf_checkpoint={dirs[3]}", "execution.tensor_parallel=2",
                           "training.global_batch_size=2", *common],
               "tp2_qwen2": [f"model.hf_checkpoint={qwen2}", "execution.tensor_parallel=2",
                             "training.global_batch_size=2", *common],
               "dp2_kv2": [f"model.hf_checkpoint={dirs[2]}", "execution.data_parallel=2", "execution.rts=true",
                           "training.global_batch_size=4", *common],
               "tp2_tied": [f"model.hf_checkpoint={tied['llama']}", "execution.tensor_parallel=2",
                            "training.global_batch_size=2", *common],
               "dp2_tied_qwen2": [f"model.hf_checkpoint={tied['qwen2']}", "execution.data_parallel=2",
                                  "execution.rts=true", "training.global_batch_size=4", *common]}
    for name, (results, got) in equal_to_one_process(hooks, configs, 5, tmp_path).items():
        assert results[0].grad_norm > 0.5  # clipping is active
        assert ("lm_head.weight" in got["weights"]["head"]) == ("tied" not in name)


def equal_to_one_process(hooks, configs: dict[str, list[str]], steps: int, tmp_path) -> dict:
    """Train each of ``configs`` for ``steps`` steps on two Gloo ranks and in one process (its overrides without
    the TP and DP keys): losses, norms and every gathered weight within 1e-5, and every rank's traffic and store
    its plan. Per config, the one process's step results and rank 0's record."""
    spawn(2, dist_workers.train_configs, configs, steps, str(tmp_path), None, tmp=tmp_path)
    out = {}
    for name, overrides in configs.items():
        single = [o for o in overrides if not o.startswith(("execution.tensor_parallel", "execution.data_parallel"))]
        cfg = load_config(None, single, hooks.registrations.config_sections)
        engine = build_engine(cfg, hooks)
        data = data_source(cfg)
        results = [engine.step(replica_batch(cfg, data, s, engine.layout),
                               learning_rate(s, steps, cfg.training.optimizer.learning_rate)) for s in range(steps)]
        got = torch.load(tmp_path / f"{name}.rank0.pt")
        for a, b in zip(got["losses"], [r.loss for r in results], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), name
        for a, b in zip(got["norms"], [r.grad_norm for r in results], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), name
        for unit, w in engine.model.full_weights().items():
            for n, t in w.items():
                assert max_rel(got["weights"][unit][n], t) <= 1e-5, f"{name} {unit}.{n}"
        for rank in range(2):
            mine = torch.load(tmp_path / f"{name}.rank{rank}.pt")
            assert mine["traffic"] == mine["planned"], (name, rank)
            assert mine["host_bytes"] == mine["planned_host"], (name, rank)
        out[name] = results, got
    return out


def test_key_value_heads_split_only_when_tensor_parallelism_divides_them(hooks, tmp_path):
    """At TP=2, 2 key/value heads split by rows; 3 stay whole on each rank, which the plan counts: the k and v
    weights' extra half on every rank, in the store and in every optimizer update's traffic."""
    specs, stored = {}, {}
    for kv in (2, 3):
        _, src = save_hf(tmp_path / f"kv{kv}", "llama", num_key_value_heads=kv)
        cfg = config(hooks, src, "execution.tensor_parallel=2", "training.global_batch_size=2")
        parts = build_model(cfg, hooks)
        specs[kv] = parts.shard_specs["decoder"]["self_attn.k_proj.weight"].tp_dim
        stored[kv] = estimate(cfg, parts, hooks)["host_bytes"]
    assert specs == {2: 0, 3: None}
    # kv=3 against kv=2: each rank holds k and v whole (3·8 rows of 48) instead of half of 2·8 rows, in float32, in
    # both layers: the weights, Adam's m and v, and the gradient (stored between the backward and the update).
    extra = 2 * 2 * (3 * 8 - 2 * 8 // 2) * 48 * 4 * 4
    assert stored[3] - stored[2] == extra


def export_after_lr_0(hooks, src, tmp_path):
    """Import ``src``, train two steps at learning rate 0, export: the export's directory."""
    run = tmp_path / "run"
    cfg = config(hooks, src, "training.global_batch_size=2", "training.steps=2",
                 "training.optimizer.learning_rate.maximum=0.0", f"output_dir={run}")
    train(cfg, hooks, progress=False)
    return export_hf(run, tmp_path / "exported", hooks)


@pytest.mark.parametrize("kind", KINDS)
def test_import_train_at_lr_0_export_is_bit_exact_and_loads_in_transformers(hooks, hf_dirs, tmp_path, kind):
    import transformers

    hf, src = hf_dirs[kind]
    out = export_after_lr_0(hooks, src, tmp_path)
    exported = load_file(str(out / "model.safetensors"))
    original = hf.state_dict()
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["bos_token_id"], written["eos_token_id"]) == (kind, 1, 2)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf)
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


# (kind, config.json changes): a tied checkpoint is one more entry, ("qwen2", {"tie_word_embeddings": True}).
INIT_SOURCES = {"llama": ("llama", {}), "qwen2": ("qwen2", {}),
                "qwen2_tied": ("qwen2", {"tie_word_embeddings": True})}


@pytest.mark.parametrize("source", list(INIT_SOURCES))
def test_a_new_run_starts_from_a_run_of_a_checkpoint_with_its_whole_model(hooks, tmp_path, capsys, source):
    """``model.init_checkpoint=RUN`` of a Llama-architecture run, with no --config: the family, the components,
    every shape and ``plugins.llama`` option (grouped-query heads, Llama 3.1's rope scaling, Qwen2's biases) and
    the special tokens come from the run's config, not from the default preset; the engine starts from the
    run's last weights and trains; a typed key of the model that disagrees is one line."""
    from omegaconf import OmegaConf

    from ipuft.io.checkpoint import find_checkpoint

    kind, extra = INIT_SOURCES[source]
    _, src = save_hf(tmp_path / "hf", kind, seed=3, **extra)
    first = train(config(hooks, src, "training.global_batch_size=2", "training.steps=1",
                         f"output_dir={tmp_path / 'a'}"), hooks, progress=False)
    assert torch.isfinite(torch.tensor(first[0]["loss"]))
    sections = hooks.registrations.config_sections
    notes = []
    cfg = load_config("small-cpu", [f"model.init_checkpoint={tmp_path / 'a'}", "model.precision=float32",
                                    "training.global_batch_size=2", "execution.micro_batch_size=1", "data.path=null",
                                    "training.steps=2", f"output_dir={tmp_path / 'b'}"], sections, default_preset=True,
                      notes=notes)
    (note,) = notes  # the fine-tuning recipe, with the sequence length the run trained at
    assert note.startswith("recipe finetune, as model.init_checkpoint is given without --config: model.sequence_length"
                           "=16 (the run it starts from trained at 16; at most 2048); model.precision=float32 (yours); ")
    assert cfg.model.sequence_length == 16
    source_cfg = OmegaConf.load(find_checkpoint(tmp_path / "a") / "config.yaml")
    assert OmegaConf.to_container(cfg.plugins.llama) == OmegaConf.to_container(source_cfg.plugins.llama)
    assert cfg.plugins.llama.kv_heads == 2 and cfg.plugins.llama.qkv_bias == (kind == "qwen2")
    if kind == "llama":
        assert cfg.plugins.llama.rope_scaling.rope_type == "llama3"
    for key in ("family", "embeddings", "decoder", "head", "layers", "hidden_size", "intermediate_size",
                "layer_norm_epsilon", "embedding", "attention", "bos_token_id", "eos_token_ids", "tie_embeddings"):
        assert cfg.model[key] == source_cfg.model[key], key
    assert cfg.model.tie_embeddings == ("tied" in source)
    assert (cfg.model.family, cfg.model.decoder, cfg.model.hidden_size) == (kind, "llama", 48)
    engine = build_engine(cfg, hooks)
    saved = load_file(str(find_checkpoint(tmp_path / "a") / "model.safetensors"))
    for unit, tensors in engine.model.weights().items():
        for name, tensor in tensors.items():
            assert torch.equal(tensor, saved[f"{unit}.{name}"]), (unit, name)
    second = train(cfg, hooks, progress=False)
    assert [r["step"] for r in second] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in second)
    capsys.readouterr()  # transformers' progress bars of save_hf
    code, out, err = cli(capsys, "train", f"model.init_checkpoint={tmp_path / 'a'}", "plugins.llama.kv_heads=3",
                         f"output_dir={tmp_path / 'c'}")
    assert (code, out) == (2, "")
    assert err == (f"ipuft: error: model.init_checkpoint {find_checkpoint(tmp_path / 'a')}: plugins.llama.kv_heads=3 "
                   f"but the checkpoint has 2 (drop those settings: the checkpoint's weights fix the model)\n")
    assert not (tmp_path / "c").exists()
    # Resuming the new run keeps its whole model too: plugins.llama is a key of the model it resumes.
    code, _, err = cli(capsys, "train", "--checkpoint", str(tmp_path / "b"), "plugins.llama.kv_heads=3",
                       "training.steps=3")
    assert code == 2 and err.count("\n") == 1
    assert "would change plugins.llama.kv_heads 2 -> 3;" in err


@pytest.fixture(scope="module")
def styled_dirs(tmp_path_factory):
    """A Llama checkpoint with a Llama-3-style tokenizer (its post-processor adds <|begin_of_text|>), one with a
    ChatML tokenizer as SmolLM2-Instruct has (it adds nothing, though config.json's bos_token_id is
    <|im_start|>), and a Qwen2 one with the ChatML tokenizer; positions and rope bases of their own."""
    root = tmp_path_factory.mktemp("styled")
    return {"llama3": save_hf(root / "llama3", "llama", seed=3, tokenizer="llama3"),
            "chatml": save_hf(root / "chatml", "llama", seed=4, tokenizer="chatml", max_position_embeddings=48,
                              rope_theta=20000.0, rope_scaling=None),
            "qwen2": save_hf(root / "qwen2", "qwen2", seed=5, tokenizer="chatml", max_position_embeddings=40)}


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_generation_encodes_as_the_tokenizer_does_and_stops_at_the_checkpoints_eos(capsys, styled_dirs, style):
    """Greedy decoding from the checkpoint's directory equals transformers' on the prompt as transformers'
    tokenizer encodes it: bos first for Llama 3's, nothing forced for a ChatML tokenizer that adds none; a row
    stops at config.json's eos."""
    from transformers import AutoTokenizer

    hf, src = styled_dirs[style]
    prompt = "w5 w17 w9 w40"
    ids = torch.tensor([AutoTokenizer.from_pretrained(src)(prompt)["input_ids"]])
    assert ids[0].tolist() == ([1] if style == "llama3" else []) + [5, 17, 9, 40]
    code, out, err = cli(capsys, "generate", "--checkpoint", str(src), "--max-new-tokens", "8", prompt)
    assert code == 0, err
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             eos_token_id=2, pad_token_id=0)
    new = theirs[0, ids.shape[1]:].tolist()
    if 2 in new:
        new = new[: new.index(2) + 1]
    from ipuft.data.tokenizer import load_tokenizer

    assert out == prompt + load_tokenizer(str(src)).decode(new, skip_special_tokens=False) + "\n"


MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "generation_config.json")


@pytest.mark.parametrize("style", ["llama3", "chatml", "qwen2"])
def test_an_export_keeps_config_json_and_the_tokenizer_files(hooks, styled_dirs, tmp_path, style):
    """Trained from a checkpoint's directory, the run's checkpoint carries the source's config.json and tokenizer
    files, and its export writes them back: config.json field for field (positions, rope, ids, window; only the
    dtype the run decides), the tokenizer's files byte for byte, so AutoConfig and AutoTokenizer on the export
    give the source's."""
    from transformers import AutoConfig, AutoTokenizer

    _, src = styled_dirs[style]
    run = tmp_path / "run"
    cfg = config(hooks, src, "training.global_batch_size=2", "training.steps=1",
                 "training.optimizer.learning_rate.maximum=0.0", f"output_dir={run}")
    train(cfg, hooks, progress=False)
    checkpoint = find_checkpoint(run)
    assert {"hf_config.json", *MODEL_FILES} <= set(json.loads((checkpoint / "manifest.json").read_text()))
    out = export_hf(run, tmp_path / "exported", hooks, dtype="bfloat16")
    source = json.loads((src / "config.json").read_text())
    assert source["max_position_embeddings"] == {"llama3": 64, "chatml": 48, "qwen2": 40}[style]  # not 2048
    assert json.loads((out / "config.json").read_text()) == {**source, "dtype": "bfloat16"}
    for name in MODEL_FILES:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    theirs, ours = AutoConfig.from_pretrained(src), AutoConfig.from_pretrained(out)
    for key in ("max_position_embeddings", "rope_parameters", "bos_token_id", "eos_token_id", "sliding_window",
                "rms_norm_eps", "num_key_value_heads"):
        assert getattr(ours, key, None) == getattr(theirs, key, None), key
    theirs, ours = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(out)
    assert (ours.bos_token, ours.eos_token, ours.chat_template) == (theirs.bos_token, theirs.eos_token,
                                                                     theirs.chat_template)
    assert ours.chat_template is not None and ours.eos_token is not None
    messages = [{"role": "user", "content": "w5 w6"}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)
    if style != "qwen2":  # transformers reads a qwen2 directory's tokenizer as a byte-level BPE, not this one
        assert ours("w5 w6")["input_ids"] == theirs("w5 w6")["input_ids"] == ([1] if style == "llama3" else []) + [5, 6]


def test_the_model_files_are_read_as_untrusted_data(hooks, styled_dirs, tmp_path, capsys):
    """A hub cache snapshot's links into its blobs are followed; a link out of the directory, a JSON file that is
    not an object, or one over its size are one line naming the file, before the run writes anything."""

    from ipuft.io.checkpoint import SOURCE_CONFIG
    from ipuft.run.resume import run_files

    _, src = styled_dirs["chatml"]
    repo = tmp_path / "hub" / "models--someone--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    shutil.copytree(src, snapshot)
    (repo / "blobs").mkdir()
    for name in MODEL_FILES:  # as huggingface_hub lays a snapshot out: each file a link to its blob
        (snapshot / name).rename(repo / "blobs" / name)
        (snapshot / name).symlink_to(f"../../blobs/{name}")
    files = run_files(config(hooks, snapshot))
    assert files[SOURCE_CONFIG] == (src / "config.json").read_bytes()
    assert {name: files[name] for name in MODEL_FILES} == {name: (src / name).read_bytes() for name in MODEL_FILES}

    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    cases = {"link": (lambda d: (d / "tokenizer_config.json").unlink() or
                      (d / "tokenizer_config.json").symlink_to(outside), "is a link out of its directory"),
             "array": (lambda d: (d / "tokenizer_config.json").write_text("[1, 2]"), "must be a JSON object, not list"),
             "json": (lambda d: (d / "generation_config.json").write_text("{"), "is not valid JSON"),
             "big": (lambda d: (d / "chat_template.jinja").write_bytes(b" " * (1 << 20 | 1)), "is larger than")}
    for name, (damage, fragment) in cases.items():
        bad = tmp_path / name
        shutil.copytree(src, bad)
        damage(bad)
        code, _, err = cli(capsys, "train", f"model.hf_checkpoint={bad}", "model.sequence_length=16",
                           "training.global_batch_size=4", f"output_dir={tmp_path / name}-run")
        err = without_recipe(err)
        assert code == 2 and err.startswith(f"ipuft: error: model.hf_checkpoint: {bad}/") and fragment in err, name
        assert err.count("\n") == 1 and not (tmp_path / f"{name}-run").exists(), name


def test_an_export_refuses_a_source_config_that_does_not_describe_the_model(hooks, styled_dirs):
    """The source's config.json is written back only where the family reads it as the run's model."""
    from ipuft.io.hf_export import hf_config

    _, src = styled_dirs["llama3"]
    cfg = config(hooks, src)
    family = hooks.registrations.families.get("llama")
    source = json.loads((src / "config.json").read_text())
    assert hf_config(cfg, family, None, source=source)["rope_parameters"] == source["rope_parameters"]
    other = {**source, "rope_parameters": {**source["rope_parameters"], "rope_theta": 10000.0}}
    with pytest.raises(CheckpointError, match=r"does not describe the model: rope_theta=10000.0 but "
                                              r"model.attention.rotary_positional_embeddings_base=5000.0"):
        hf_config(cfg, family, None, source=other)


def test_a_config_json_it_cannot_run_is_one_line_and_writes_nothing(hooks, hf_dirs, tmp_path):
    src = hf_dirs["llama"][1]
    base = json.loads((src / "config.json").read_text())
    cases = {
        "unknown": ({"model_type": "bert"}, "has model_type 'bert'; the installed plugins read 'gemma2', 'gemma3_text', 'gptj', 'llama'"),
        "missing": ({"hidden_size": None}, "lacks hidden_size"),
        "heads": ({"num_attention_heads": 5, "head_dim": None}, "num_attention_heads=5 does not divide hidden_size=48"),
        "kv": ({"num_key_value_heads": 4}, "num_key_value_heads=4 does not divide num_attention_heads=6"),
        "tied": ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false, got the string 'yes'"),
        "act": ({"hidden_act": "gelu"}, "hidden_act 'gelu': ipuft runs llama's SwiGLU MLP with silu only"),
        "rope": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters's rope_type 'yarn'"),
        "type": ({"vocab_size": "101"}, "vocab_size must be a positive integer, got the string '101'"),
    }
    for name, (change, fragment) in cases.items():
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({k: v for k, v in {**base, **change}.items() if v is not None}))
        before = sorted(p.name for p in tmp_path.rglob("*"))
        with pytest.raises(CheckpointError) as info:
            config(hooks, bad)
        assert fragment in str(info.value) and "\n" not in str(info.value), name
        assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_phased_bfloat16_equals_a_plain_bfloat16_reference(hooks, hf_dirs):
    """In bfloat16 with stochastic rounding, from a Llama checkpoint, the phased engine (offload, recompute with
    the gradient-only down projection, float32 CPU attention) against a plain bfloat16 autograd reference of
    the same modules and the same rounding bits, within the bounds :func:`test_precision.assert_16bit_close`
    justifies (one bfloat16 rounding for loss and norm; one 16-bit step plus 2·lr per step for each weight)."""
    from test_engine import EQUIVALENCE, batches
    from test_precision import BF16_SR, assert_16bit_close, plain_16bit_reference

    shapes = [o for o in EQUIVALENCE if not o.startswith("model.layers")]  # the checkpoint's 2 layers
    cfg = config(hooks, hf_dirs["llama"][1], *shapes, *BF16_SR)
    engine = build_engine(cfg, hooks)  # the checkpoint's weights, rounded to bfloat16
    initial = {u: {n: t.clone() for n, t in w.items()} for u, w in engine.model.weights().items()}
    step_batches = batches(cfg)
    results = [engine.step(b, learning_rate(s, cfg.training.steps, cfg.training.optimizer.learning_rate))
               for s, b in enumerate(step_batches)]
    expected = plain_16bit_reference(cfg, engine.modules, initial, step_batches)
    float32 = plain_16bit_reference(cfg, engine.modules, {u: {n: t.float() for n, t in w.items()}
                                                          for u, w in initial.items()}, step_batches)[2]
    assert_16bit_close(cfg, results, engine.model.weights(), expected, float32, torch.bfloat16)


def test_a_checkpoint_stands_alone_once_its_source_is_gone(capsys, tmp_path, monkeypatch):
    """A run started from a relative model.hf_checkpoint: export and generate from its checkpoint, from another
    working directory and after the source directory is deleted, give what they gave beside it, and the run
    resumes: the checkpoint holds the model, its config.json and its tokenizer."""
    work = tmp_path / "work"
    save_hf(work / "src", "llama", seed=6, tie_word_embeddings=True)
    monkeypatch.chdir(work)
    code, _, err = cli(capsys, "train", "model.hf_checkpoint=src", "model.sequence_length=16", "model.precision=float32",
                       "training.global_batch_size=2", "training.steps=1", "output_dir=run")
    assert code == 0, err
    prompt = ["--max-new-tokens", "5", "--json", "w5 w17 w9"]

    def outputs(out: Path) -> tuple[dict, dict]:
        code, _, err = cli(capsys, "export", "--checkpoint", str(work / "run"), "--hf", str(out))
        assert code == 0, err
        code, text, err = cli(capsys, "generate", "--checkpoint", str(work / "run"), *prompt)
        assert code == 0, err
        return {p.name: p.read_bytes() for p in sorted(out.iterdir())}, json.loads(text)["completions"]

    files, completions = outputs(tmp_path / "beside")
    assert "config.json" in files and "tokenizer.json" in files
    shutil.rmtree(work / "src")
    monkeypatch.chdir(tmp_path)
    assert outputs(tmp_path / "alone") == (files, completions)
    code, _, err = cli(capsys, "train", "--checkpoint", str(work / "run"), "training.steps=2",
                       f"output_dir={work / 'run'}")  # and it resumes
    assert code == 0, err
    assert [json.loads(line)["step"] for line in (work / "run" / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line][-1] == 2
