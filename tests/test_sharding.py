"""The sharding contract: what each GPT-J plugin answers, and core's shard arithmetic."""

import pytest
import torch

from ipuft.components import VariableSpec
from ipuft.errors import ConfigError, PluginError
from ipuft.model import build_model
from ipuft.sharding import ShardSpec, resolve_shard_specs


def test_tp1_is_trivial(hooks, make_config):
    parts = build_model(make_config(), hooks)
    for role, specs in parts.shard_specs.items():
        for var in parts.variables[role]:
            assert specs[var.name].local_shape(var.shape, 1) == var.shape


def test_gptj_specs_at_tp2(hooks, make_config):
    parts = build_model(make_config("execution.tensor_parallel=2"), hooks)
    local = {role: {v.name: parts.shard_specs[role][v.name].local_shape(v.shape, 2) for v in parts.variables[role]}
             for role in parts.variables}
    assert local["embeddings"] == {"wte.weight": (64, 64)}  # vocab 128 padded to a multiple of 32, halved
    assert local["decoder"] == {
        "norm.weight": (64,), "norm.bias": (64,),
        "attn.q_proj.weight": (32, 64), "attn.k_proj.weight": (32, 64), "attn.v_proj.weight": (32, 64),
        "attn.out_proj.weight": (64, 32),
        "mlp.fc_in.weight": (128, 64), "mlp.fc_in.bias": (128,),
        "mlp.fc_out.weight": (64, 128), "mlp.fc_out.bias": (64,),
    }  # fmt: skip
    assert local["head"] == {"norm.weight": (64,), "norm.bias": (64,), "proj.weight": (64, 64), "proj.bias": (64,)}
    assert all(spec.rts for specs in parts.shard_specs.values() for spec in specs.values())


def test_vocab_padding_and_round_trip():
    spec = ShardSpec(tp_dim=0, pad_multiple=16)
    full = torch.arange(100 * 3, dtype=torch.float32).reshape(100, 3)
    assert spec.padded_size(100, 4) == 128
    shards = [spec.shard(full, r, 4) for r in range(4)]
    assert [s.shape for s in shards] == [(32, 3)] * 4
    assert torch.equal(shards[3][4:], torch.zeros(28, 3))  # rows 100..127 are padding
    assert torch.equal(spec.unshard(shards, full_size=100), full)


def test_row_shards_reassemble():
    spec = ShardSpec(tp_dim=1)
    full = torch.randn(6, 8)
    assert torch.equal(spec.unshard([spec.shard(full, r, 2) for r in range(2)]), full)


def test_no_answer_needs_tp1():
    variables = [VariableSpec("w", (4, 4))]
    assert resolve_shard_specs("head 'x'", variables, None, 1) == {"w": ShardSpec()}
    with pytest.raises(ConfigError, match="declares no tensor-parallel sharding"):
        resolve_shard_specs("head 'x'", variables, None, 2)


def test_answer_must_cover_every_variable():
    variables = [VariableSpec("w", (4, 4)), VariableSpec("b", (4,))]
    with pytest.raises(PluginError, match=r"missing: \['b'\]"):
        resolve_shard_specs("head 'x'", variables, {"w": ShardSpec()}, 1)
    with pytest.raises(PluginError, match="splits dim 1"):
        resolve_shard_specs("head 'x'", variables, {"w": ShardSpec(), "b": ShardSpec(tp_dim=1)}, 2)
    with pytest.raises(ConfigError, match="does not split"):
        resolve_shard_specs("head 'x'", [VariableSpec("w", (5, 4))], {"w": ShardSpec(tp_dim=0)}, 2)
