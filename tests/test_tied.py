"""Tied embeddings (``model.tie_embeddings``, Hugging Face's ``tie_word_embeddings``): the head's projection is
the embeddings' table, one variable stored, trained, normed and exported once (:class:`ipuft.program.Tie`).

Against transformers' tied LlamaForCausalLM, Qwen2ForCausalLM and GPTJForCausalLM on random checkpoints of odd
shapes: logits, loss and every gradient (the tied matrix's is the sum of its two uses), three AdamW steps in
each layout that moves variables differently, bfloat16 against a plain bfloat16 reference (TP=2 and DP=2 with
RTS equal to one process: tests/test_llama.py), the plan's bytes exact, and import → train(lr=0) → export bit-exact and tied."""

import json

import pytest
import torch
from hf_reference import hf_state, hf_units
from llama_reference import hf_model, save_hf
from safetensors.torch import load_file
from test_engine import max_rel
from test_llama import adam_config, export_after_lr_0, hf_adam_steps
from test_parity_hf import ipuft_forward

from ipuft.components import IGNORE_INDEX
from ipuft.config import load_config
from ipuft.data.tokens import data_source
from ipuft.engine.model import build_model
from ipuft.errors import PluginError
from ipuft.plan.estimate import estimate
from ipuft.program import Op, StepProgram, Tie, Unit, emit_standard_phases
from ipuft.run.runtime import build_engine
from ipuft.run.schedule import learning_rate
from ipuft.run.train import replica_batch

KINDS = ["llama", "qwen2"]
TABLE = ("embeddings", "embed_tokens.weight")


@pytest.fixture(scope="module")
def tied_dirs(tmp_path_factory):
    """Each kind's random tied model (no lm_head.weight in its safetensors), saved with a tokenizer."""
    root = tmp_path_factory.mktemp("tied")
    dirs = {kind: save_hf(root / kind, kind, seed=11 + i, tie_word_embeddings=True) for i, kind in enumerate(KINDS)}
    return dirs | {"qwen2-untied": save_hf(root / "qwen2-untied", "qwen2", seed=12)}


def config(hooks, src, *extra):
    return load_config(None, [f"model.hf_checkpoint={src}", "model.sequence_length=16", *extra],
                       hooks.registrations.config_sections)


def test_a_tied_checkpoint_sets_the_key_and_its_head_owns_no_projection(hooks, tied_dirs):
    cfg = config(hooks, tied_dirs["llama"][1])
    assert cfg.model.tie_embeddings is True
    parts = build_model(cfg, hooks)
    assert [v.name for v in parts.variables["head"]] == ["norm.weight"]
    assert [v.name for v in parts.tied["head"]] == ["lm_head.weight"]
    assert parts.program.ties == (Tie("head", "lm_head.weight", Unit("embeddings"), "embed_tokens.weight"),)
    untied = build_model(config(hooks, tied_dirs["qwen2-untied"][1]), hooks)
    assert [v.name for v in untied.variables["head"]] == ["norm.weight", "lm_head.weight"]
    assert untied.program.ties == ()


@pytest.mark.parametrize("kind", KINDS)
def test_logits_loss_and_every_gradient_match_transformers(hooks, tied_dirs, kind):
    hf, src = tied_dirs[kind]
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    parts = build_model(config(hooks, src), hooks)
    leaves = {k: v.detach().clone().requires_grad_() for k, v in hf.state_dict().items()
              if k != "lm_head.weight"}
    units = hf_units(parts.modules, 2, leaves)
    units["head"]["lm_head.weight"] = units["embeddings"]["embed_tokens.weight"]  # one tensor, both uses
    ids = torch.randint(0, 101, (3, 16), generator=torch.Generator().manual_seed(1))
    hf.zero_grad()
    hf_out = hf(ids, labels=ids)
    torch.testing.assert_close(ipuft_forward(parts, units, ids), hf_out.logits, atol=1e-5, rtol=0)
    labels = torch.cat([ids[:, 1:], torch.full((3, 1), IGNORE_INDEX)], dim=1)
    loss = ipuft_forward(parts, units, ids, labels)
    torch.testing.assert_close(loss, hf_out.loss, atol=1e-6, rtol=1e-6)
    hf_out.loss.backward()
    loss.backward()
    ours = hf_state(parts.modules, 2, units)
    hf_params = dict(hf.named_parameters())  # the tied matrix once, as model.embed_tokens.weight
    assert set(ours) == set(hf_params)
    for name, p in hf_params.items():
        torch.testing.assert_close(ours[name].grad, p.grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("kind,layout", [
    ("llama", ()),
    ("qwen2", ()),
    ("llama", ("execution.offload=false", "execution.recompute=false")),
    ("qwen2", ("execution.optimizer_placement=host",)),
    ("llama", ("execution.activation_offload=true", "execution.micro_batch_size=1")),
], ids=["llama", "qwen2", "no-offload-no-recompute", "host-update", "activation-offload-ga4"])
def test_three_adam_steps_equal_transformers_tied_model(hooks, tied_dirs, kind, layout):
    """The tied matrix's gradient is the sum of the head's and the lookup's, counted once in the global norm
    and updated once: losses, norms and every weight equal transformers' tied model with torch's AdamW."""
    src = tied_dirs[kind][1]
    hf = hf_model(kind, seed=11 + KINDS.index(kind), tie_word_embeddings=True)
    cfg = adam_config(hooks, src, *layout)
    engine = build_engine(cfg, hooks)
    for (loss, hf_loss), (norm, hf_norm) in hf_adam_steps(hf, cfg, engine):
        assert abs(loss - hf_loss) <= 1e-5 * abs(hf_loss)
        assert abs(norm - hf_norm) <= 1e-5 * hf_norm
    ours = hf_state(engine.modules, 2, engine.model.full_weights())
    assert "lm_head.weight" not in ours
    for name, p in hf.named_parameters():
        assert max_rel(ours[name], p.detach()) <= 1e-5, name
    planned = estimate(cfg, engine.parts, hooks)
    result = engine.step(replica_batch(cfg, data_source(cfg), 3, engine.layout), 1e-3)
    assert result.traffic == planned["traffic"]
    acts = planned["activation_bytes"] if cfg.execution.activation_offload else 0
    assert engine.store.host_bytes() == planned["host_bytes"] - acts


def test_a_gptj_head_ties_through_the_key(hooks, make_config, tmp_path):
    """GPT-J has no tied checkpoints, but ``model.tie_embeddings=true`` ties its head's weight (its bias stays
    the head's), as transformers' GPTJForCausalLM(tie_word_embeddings=True) does; a checkpoint saying so sets
    the key."""
    from hf_reference import hf_gptj
    from llama_reference import tokenizer_json

    cfg = make_config("model.tie_embeddings=true")
    assert [v.name for v in build_model(cfg, hooks).variables["head"]] == ["norm.weight", "norm.bias", "proj.bias"]
    hf = hf_gptj(cfg, tie_word_embeddings=True)
    assert hf.lm_head.weight is hf.transformer.wte.weight
    hf.save_pretrained(tmp_path / "gptj", safe_serialization=True)
    tokenizer_json(tmp_path / "gptj" / "tokenizer.json", cfg.model.embedding.vocab_size)
    cfg = load_config(None, [f"model.hf_checkpoint={tmp_path / 'gptj'}", "training.global_batch_size=4",
                             "execution.micro_batch_size=2", "training.steps=3",
                             "training.optimizer.learning_rate.maximum=1e-3",
                             "training.optimizer.gradient_clipping=1e9", "plugins.adamw.weight_decay=0.0",
                             "plugins.adamw.eps=1e-6", f"model.sequence_length={cfg.model.sequence_length}"],
                      hooks.registrations.config_sections)
    assert cfg.model.tie_embeddings is True
    engine = build_engine(cfg, hooks)
    for (loss, hf_loss), (norm, hf_norm) in hf_adam_steps(hf, cfg, engine):
        assert abs(loss - hf_loss) <= 1e-5 * abs(hf_loss)
        assert abs(norm - hf_norm) <= 1e-5 * hf_norm
    ours = hf_state(engine.modules, cfg.model.layers, engine.model.full_weights())
    for name, p in hf.named_parameters():
        assert max_rel(ours[name], p.detach()) <= 1e-5, name


@pytest.mark.parametrize("recipe", [(), ("model.precision=bfloat16", "training.stochastic_rounding=true")],
                         ids=["float32", "bf16-sr"])
@pytest.mark.parametrize("placement", ["device", "host"])
def test_the_plan_counts_the_tied_matrix_once(hooks, tied_dirs, recipe, placement):
    """Tied against untied, exactly: the head's matrix and its optimizer state are gone; its gradient, stored
    between the head's backward and the embeddings' in both, is float32 when the weights are 16-bit (the two
    uses' parts summed exactly); with updates in host memory, where the embeddings' own gradient is stored
    too, the untied model's second gradient is gone as well. The engine's store holds what the plan says."""
    extra = ("training.global_batch_size=2", f"execution.optimizer_placement={placement}", *recipe)
    tied, untied = (config(hooks, tied_dirs[kind][1], *extra) for kind in ("qwen2", "qwen2-untied"))
    planned = {name: estimate(c, build_model(c, hooks), hooks) for name, c in (("tied", tied), ("untied", untied))}
    matrix = 101 * 48
    itemsize = 2 if recipe else 4
    weight, state = matrix * itemsize, 2 * matrix * 4  # adamw's m and v are float32
    # On the device the one stored gradient is float32 instead; in host memory, one float32 gradient instead of two.
    gradient = matrix * 4 - (1 if placement == "device" else 2) * matrix * itemsize
    assert planned["untied"]["host_bytes"] - planned["tied"]["host_bytes"] == weight + state - gradient
    assert planned["untied"]["parameters"] - planned["tied"]["parameters"] == matrix
    engine = build_engine(tied, hooks)
    assert engine.store.host_bytes() == planned["tied"]["host_bytes"]


def test_bfloat16_equals_a_plain_bfloat16_reference_of_the_tied_model(hooks, tied_dirs):
    """bfloat16 with stochastic rounding: the phased engine against a plain bfloat16 autograd reference whose
    tied matrix has one leaf per use and the float32 sum of both as its gradient, rounded once, within the
    bounds :func:`test_precision.assert_16bit_close` justifies."""
    from test_engine import EQUIVALENCE, batches
    from test_precision import BF16_SR, assert_16bit_close, plain_16bit_reference

    shapes = [o for o in EQUIVALENCE if not o.startswith("model.layers")]
    cfg = config(hooks, tied_dirs["llama"][1], *shapes, *BF16_SR)
    engine = build_engine(cfg, hooks)
    initial = {u: {n: t.clone() for n, t in w.items()} for u, w in engine.model.weights().items()}
    step_batches = batches(cfg)
    results = [engine.step(b, learning_rate(s, cfg.training.steps, cfg.training.optimizer.learning_rate))
               for s, b in enumerate(step_batches)]
    ties = {("head", "lm_head.weight"): TABLE}
    expected = plain_16bit_reference(cfg, engine.modules, initial, step_batches, ties)
    float32 = plain_16bit_reference(cfg, engine.modules, {u: {n: t.float() for n, t in w.items()}
                                                          for u, w in initial.items()}, step_batches, ties)[2]
    assert_16bit_close(cfg, results, engine.model.weights(), expected, float32, torch.bfloat16)


def test_freezing_the_embeddings_freezes_the_tied_matrix_in_the_head_too(hooks, tied_dirs):
    cfg = adam_config(hooks, tied_dirs["qwen2"][1], "model.freeze=[embeddings]")
    engine = build_engine(cfg, hooks)
    before = engine.model.full_weights()
    for step in range(2):
        engine.step(replica_batch(cfg, data_source(cfg), step, engine.layout), 1e-3)
    after = engine.model.full_weights()
    assert torch.equal(after["embeddings"]["embed_tokens.weight"], before["embeddings"]["embed_tokens.weight"])
    assert not torch.equal(after["head"]["norm.weight"], before["head"]["norm.weight"])
    assert "grad" not in engine.store.entries["embeddings"]


@pytest.mark.parametrize("kind", KINDS)
def test_import_train_at_lr_0_export_is_bit_exact_tied_and_loads_in_transformers(hooks, tied_dirs, tmp_path, kind):
    import transformers

    hf, src = tied_dirs[kind]
    out = export_after_lr_0(hooks, src, tmp_path)
    exported = load_file(str(out / "model.safetensors"))
    original = load_file(str(src / "model.safetensors"))
    assert "lm_head.weight" not in exported
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)


@pytest.mark.parametrize("offload", [True, False])
def test_generation_and_eval_of_a_tied_model_equal_transformers(hooks, tied_dirs, offload):
    """The layer-major runner borrows the table for the head: greedy continuations equal transformers', and the
    inference plan's device peak is what the runner's ledger counts."""
    from hf_reference import hf_runner

    from ipuft.engine.generation import generate
    from ipuft.plan.estimate import inference_estimate

    hf, src = tied_dirs["llama"]
    cfg = config(hooks, src, f"execution.offload={str(offload).lower()}")
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    runner = hf_runner(cfg, hooks, state)
    prompts = [[(7 * r + i) % 90 + 3 for i in range(5)] for r in range(3)]
    runner.store.reset_peak()
    ours = generate(runner, prompts, 6)
    planned = inference_estimate(cfg, runner.model.parts, batch_size=3, prompt_tokens=5, new_tokens=6)
    assert planned["device_peak_bytes"] == runner.store.device_peak
    with torch.no_grad():
        expected = hf.generate(torch.tensor(prompts), max_new_tokens=6, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[:, 5:]
    assert ours == expected.tolist()


def test_a_head_that_cannot_tie_is_one_line(install_plugin):
    from ipuft.errors import ConfigError

    source = """
from ipuft import hookimpl
from ipuft_lm_head import SHARD_SPECS
from ipuft_lm_head.module import GPTJLMHead

@hookimpl
def ipuft_register_components(registry):
    registry.add("head", "plain", lambda cfg: GPTJLMHead(cfg.model.hidden_size, cfg.model.embedding.vocab_size),
                 "a head that never ties", shard_specs=SHARD_SPECS)
"""
    manager = install_plugin("plainhead", source=source)
    cfg = load_config("tiny", ["model.tie_embeddings=true", "model.head=plain"], manager.registrations.config_sections)
    with pytest.raises(ConfigError, match=r"model\.tie_embeddings=true, but head component 'plain' of plugin "
                                          r"'plainhead' ties none of its variables to the embeddings"):
        build_model(cfg, manager)


def test_a_tie_whose_owner_computes_its_gradient_first_is_refused():
    """The owner adds the other uses' parts to its own gradient, so it must compute it after every use: a tie
    of the embeddings' table to the head (whose gradient comes first) is an invalid program."""
    program = StepProgram(1, (Tie("embeddings", "wte.weight", Unit("head"), "proj.weight"),))
    for role in ("embeddings", "decoder", "head"):
        emit_standard_phases(program, role)
    with pytest.raises(PluginError, match="head must compute its gradient once, after every embeddings gradient"):
        program.validate()
    ok = StepProgram(1, (Tie("head", "proj.weight", Unit("embeddings"), "wte.weight"),))
    for role in ("embeddings", "decoder", "head"):
        emit_standard_phases(ok, role)
    ok.validate()
    head = next(p for p in ok if p.ops == (Op.LOSS_BACKWARD,))
    moves = ok.moves(head, True)
    assert (moves.borrows, moves.lends) == (ok.ties, ok.ties)
    embeddings = next(p for p in ok if p.role == "embeddings" and Op.OPTIMIZER_STEP in p.ops)
    assert ok.moves(embeddings, True).carries == ok.ties
    assert ok.tied_gradients() == {Unit("embeddings"): ("wte.weight",)}


def _with_own_head(tmp_path, src, head):
    """A copy of tied directory ``src`` whose safetensors also hold ``lm_head.weight`` = ``head``."""
    import shutil

    from safetensors.torch import save_file

    out = tmp_path / "with-head"
    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    save_file({**tensors, "lm_head.weight": head}, out / "model.safetensors", {"format": "pt"})
    return out, tensors


@pytest.mark.parametrize("same", [False, True], ids=["differs", "equal"])
def test_a_tied_config_whose_weights_hold_a_head_reads_as_transformers_reads_it(hooks, tied_dirs, tmp_path, capsys,
                                                                                  same):
    """tie_word_embeddings: true with an lm_head.weight in the weights: transformers 5 unties them where the two
    differ (the head is the file's lm_head.weight) and ties them where they are equal; ipuft's logits and loss
    equal transformers' loading of the same directory either way, and the CLI says when it unties."""
    from transformers import AutoModelForCausalLM

    from ipuft.engine.inference import LayerMajor
    from ipuft.run.generate import inference_config
    from ipuft.run.runtime import inference_engine

    src = tied_dirs["llama"][1]
    table = load_file(src / "model.safetensors")["model.embed_tokens.weight"]
    head = table.clone() if same else torch.randn(table.shape, generator=torch.Generator().manual_seed(5))
    directory, _ = _with_own_head(tmp_path, src, head)
    theirs = AutoModelForCausalLM.from_pretrained(directory).eval()
    assert (theirs.lm_head.weight is theirs.model.embed_tokens.weight) is same
    cfg = inference_config(str(directory), hooks)
    assert cfg.model.tie_embeddings is same
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(2))
    ours = LayerMajor(inference_engine(cfg, hooks)).logits(ids)
    with torch.no_grad():
        expected = theirs(ids).logits
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    if not same:  # the untied head is a head of its own: the embeddings' logits are far from these
        tied_logits = LayerMajor(inference_engine(inference_config(str(src), hooks), hooks)).logits(ids)
        assert (tied_logits - expected).abs().max() > 1e-2
    from cli_helpers import run_cli

    capsys.readouterr()
    code, _, err = run_cli(capsys, "config", "show", "--config", "tiny", f"model.hf_checkpoint={directory}",
                           "model.sequence_length=16")
    assert code == 0
    note = (f"ipuft: note: model.hf_checkpoint {directory}: config.json ties the head to the embeddings "
            f"(tie_word_embeddings: true) but its lm_head.weight differs from model.embed_tokens.weight: the head "
            f"is lm_head.weight, untied, as transformers loads it\n")
    assert err == ("" if same else note)


def test_a_tied_config_whose_head_has_another_shape_is_refused_as_transformers_refuses_it(hooks, tied_dirs, tmp_path,
                                                                                            capsys):
    from test_bad_input import snapshot
    from transformers import AutoModelForCausalLM

    src = tied_dirs["llama"][1]
    table = load_file(src / "model.safetensors")["model.embed_tokens.weight"]
    directory, _ = _with_own_head(tmp_path, src, torch.zeros(table.shape[0] + 1, table.shape[1]))
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(directory)
    from cli_helpers import run_cli

    capsys.readouterr()  # transformers' own report
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "train", "--config", "tiny", f"model.hf_checkpoint={directory}",
                           f"output_dir={tmp_path / 'run'}")
    shape, table_shape = (table.shape[0] + 1, table.shape[1]), tuple(table.shape)
    assert code == 2 and err == (f"ipuft: error: model.hf_checkpoint {directory}: config.json ties the head to the "
                                 f"embeddings (tie_word_embeddings: true), but its weights hold lm_head.weight of "
                                 f"shape {shape}, not the table's {table_shape}; transformers refuses it too: "
                                 f"remove lm_head.weight or give it shape {table_shape}\n")
    assert snapshot(tmp_path) == before


def test_a_tied_config_read_untied_exports_untied_and_bit_exact(hooks, tied_dirs, tmp_path):
    """The directory transformers unties exports as the untied model it is: both tensors, bit for bit, and
    tie_word_embeddings false (the run's, not the source's), which transformers loads to the same logits."""
    import transformers

    src = tied_dirs["llama"][1]
    table = load_file(src / "model.safetensors")["model.embed_tokens.weight"]
    directory, _ = _with_own_head(tmp_path, src, torch.randn(table.shape,
                                                                   generator=torch.Generator().manual_seed(6)))
    out = export_after_lr_0(hooks, directory, tmp_path)
    exported, original = load_file(out / "model.safetensors"), load_file(directory / "model.safetensors")
    assert exported.keys() == original.keys() and all(torch.equal(exported[n], t) for n, t in original.items())
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()(ids).logits
        assert torch.equal(transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits, theirs)
