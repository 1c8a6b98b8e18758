"""The sharding contract: what each GPT-J plugin answers, and core's shard arithmetic."""

import pytest
import torch

from ipuft.components import VariableSpec
from ipuft.engine.model import build_model
from ipuft.errors import ConfigError, PluginError
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


@pytest.mark.parametrize("spec", [ShardSpec(), ShardSpec(tp_dim=0), ShardSpec(tp_dim=1), ShardSpec(tp_dim=0, pad_multiple=16)],
                         ids=["replicated", "rows", "columns", "padded-vocab"])
def test_each_layout_names_every_element_of_the_full_variable_once(spec):
    """Stochastic rounding keys each element on its index in the full variable (Placement.full_indices), or,
    where a stored range is consecutive there, on its first index alone (Placement.counters): over every rank of
    each DP × TP layout, with RTS, the indices inside the variable are each element's own, exactly once, and
    the two forms agree for every range."""
    from ipuft.engine.placement import Placement
    from ipuft.parallel import Layout

    variable = VariableSpec("w", (100, 12))
    full = torch.arange(100 * 12).reshape(100, 12)
    for dp, tp in ((1, 1), (1, 4), (3, 1), (3, 2), (2, 4)):
        if spec.tp_dim is not None and spec.pad_multiple is None and 100 % tp:
            continue
        seen = []
        for rank in range(dp * tp):
            placed = Placement(variable, spec, Layout(dp, tp, rank), rts=True)
            stored = placed.to_stored(full.float()).long().view(-1)  # each stored element's value: its full index
            n = stored.numel()
            indices = placed.full_indices(0, n)
            inside = indices < full.numel()
            assert torch.equal(indices[inside], stored[inside])  # padding (zeros in `stored`) maps past the end
            if spec.tp_dim is not None or placed.layout.tp_rank == 0:  # a TP-replicated variable: each TP rank has all
                seen.append(indices[inside])
            for start, count in ((0, n), (5, 17), (n - 3, 3), (n // 2, n - n // 2), (1, 1)):
                counters = placed.counters(start, count)
                expected = placed.full_indices(start, count)
                if isinstance(counters, int):
                    assert torch.equal(torch.arange(counters, counters + count), expected)
                else:
                    assert torch.equal(counters, expected)
            if spec.tp_dim != 1 and spec.pad_multiple is None:  # consecutive in the full variable: no tensor made
                assert isinstance(placed.counters(0, n), int)
        assert torch.equal(torch.cat(seen).sort().values, torch.arange(full.numel()))
