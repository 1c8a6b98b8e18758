"""LoRA as a plugin: from a Hugging Face checkpoint the adapters train while every base weight stays
bit-identical and has no gradient or optimizer state, and the merged export is the model ipuft trained."""

import json

import pytest
import torch
from safetensors import safe_open

from ipuft.config import load_config
from ipuft.engine.inference import LayerMajor
from ipuft.engine.model import build_model
from ipuft.engine.plan import estimate
from ipuft.errors import ConfigError
from ipuft.io.checkpoint import find_checkpoint
from ipuft.io.hf_export import export_hf
from ipuft.plugins import create_plugin_manager
from ipuft.run.generate import inference_config
from ipuft.run.runtime import inference_engine
from ipuft.run.train import train

SHAPE = ["model.layers=2", "model.hidden_size=64", "model.attention.heads=4", "model.attention.rotary_dim=8",
         "model.embedding.vocab_size=128", "model.sequence_length=16"]
LORA = ["model.decoder=gptj_lora", "model.freeze=[embeddings,head]", "plugins.lora.rank=4",
        "plugins.lora.targets=[q_proj,v_proj,fc_in]"]


@pytest.fixture(scope="module")
def hooks():
    return create_plugin_manager()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, hooks):
    """A random tiny transformers GPT-J, saved as a Hugging Face directory."""
    from transformers import GPTJConfig, GPTJForCausalLM

    cfg = load_config("tiny", SHAPE, hooks.registrations.config_sections)
    m = cfg.model
    torch.manual_seed(0)
    model = GPTJForCausalLM(GPTJConfig(vocab_size=m.embedding.vocab_size, n_positions=64, n_embd=m.hidden_size,
                                       n_layer=m.layers, n_head=m.attention.heads, rotary_dim=m.attention.rotary_dim,
                                       n_inner=4 * m.hidden_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)).eval()
    out = tmp_path_factory.mktemp("hf") / "gptj"
    model.save_pretrained(out)
    return out, model


@pytest.fixture(scope="module")
def run(tmp_path_factory, hooks, hf_dir):
    out = tmp_path_factory.mktemp("run") / "lora"
    cfg = load_config(None, [*SHAPE, *LORA, f"model.hf_checkpoint={hf_dir[0]}", "training.steps=6",
                             "training.global_batch_size=4", "execution.micro_batch_size=2",
                             "training.optimizer.learning_rate.maximum=1e-2", f"output_dir={out}"],
                      hooks.registrations.config_sections)
    records = train(cfg, hooks, progress=False)
    return cfg, out, records


def test_the_base_stays_bit_identical_and_the_adapters_train(run, hf_dir):
    cfg, out, records = run
    _, model = hf_dir
    assert records[-1]["loss"] < records[0]["loss"]
    base = model.state_dict()
    with safe_open(str(find_checkpoint(out) / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for n in range(cfg.model.layers):
            for leaf in ("attn.q_proj.weight", "attn.k_proj.weight", "mlp.fc_out.weight", "ln_1.weight"):
                local = f"decoder.{n}.{leaf.replace('ln_1', 'norm')}"
                assert torch.equal(f.get_tensor(local), base[f"transformer.h.{n}.{leaf}"]), local
            assert f.get_tensor(f"decoder.{n}.attn.q_proj.lora_B").abs().sum() > 0  # trained from zeros
        assert torch.equal(f.get_tensor("embeddings.wte.weight"), base["transformer.wte.weight"])
        assert torch.equal(f.get_tensor("head.proj.weight"), base["lm_head.weight"])
    with safe_open(str(find_checkpoint(out) / "optim.safetensors"), "pt") as f:
        state = set(f.keys())
    # Optimizer state for the adapters only: three targets × A and B × Adam's m and v, per layer.
    assert all(".lora_" in name for name in state) and len(state) == cfg.model.layers * 3 * 2 * 2
    assert {name.rsplit(".", 1)[0] for name in state} <= names


def test_no_gradient_or_optimizer_bytes_for_the_base_in_the_counters(run, hooks):
    cfg, _, records = run
    planned = estimate(cfg, build_model(cfg, hooks), hooks)
    adapters = cfg.model.layers * 4 * (4 * 64 * 2 + 4 * 64 * 2 + 4 * (64 + 256))  # float32 A and B of q, v, fc_in
    for record in records:
        assert record["traffic"] == planned["traffic"]
    # The gradients stored and moved are the adapters' alone (the frozen head stores none), and Adam's m and
    # v are twice that.
    assert planned["traffic"]["d2h"]["grad"] == adapters
    assert planned["traffic"]["h2d"]["optim"] == planned["traffic"]["d2h"]["optim"] == 2 * adapters
    assert planned["trainable_parameters"] == adapters // 4


def test_the_merged_export_gives_ipufts_logits(run, hooks, tmp_path):
    from transformers import GPTJForCausalLM

    _, out, _ = run
    exported = export_hf(out, tmp_path / "hf", hooks)
    assert not any(".lora_" in k for k in json.loads((exported / "config.json").read_text()))
    model = GPTJForCausalLM.from_pretrained(exported).eval()
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(1))
    runner = LayerMajor(inference_engine(inference_config(str(out), hooks), hooks))
    ours = runner.logits(ids)
    with torch.no_grad():
        theirs = model(ids).logits
    assert (ours - theirs).abs().max() <= 1e-5


def test_tensor_parallel_and_bad_options_are_one_line(hooks):
    def config(*extra):
        return load_config("tiny", [*SHAPE, *LORA, *extra], hooks.registrations.config_sections)

    with pytest.raises(ConfigError, match=r"model.decoder: gptj_lora runs at execution.tensor_parallel=1 \(got 2\)"):
        build_model(config("execution.tensor_parallel=2"), hooks)
    with pytest.raises(ConfigError, match=r"plugins.lora.targets: \['out_proj'\] must be distinct names among"):
        build_model(config("plugins.lora.targets=[out_proj]"), hooks)
    with pytest.raises(ConfigError, match=r"plugins.lora.rank \(used when model.decoder=gptj_lora\): it is set but"):
        load_config("tiny", ["plugins.lora.rank=4"], hooks.registrations.config_sections)
    # The adapters are GPT-J's: another family's model (a Llama's, from the ipuft-llama plugin) is refused.
    with pytest.raises(ConfigError, match=r"^model.decoder: gptj_lora adapts GPT-J's block, but the model is a llama "
                                          r"\(model.family\); LoRA for it is not available"):
        build_model(config("model.family=llama"), hooks)
