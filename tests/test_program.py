"""The step program: the reference's order, and dataflow validation of what plugins emit."""

import pytest

from ipuft.engine.model import build_model
from ipuft.errors import PluginError
from ipuft.program import Op, Phase, Stage, StepProgram


def test_gptj_plugins_emit_the_references_order(hooks, make_config):
    program = build_model(make_config("model.layers=3"), hooks).program
    assert [p.name for p in program] == [
        "embeddings:forward",
        "decoder.0:forward", "decoder.1:forward", "decoder.2:forward",
        "head:loss_backward",
        "decoder.2:backward", "decoder.1:backward", "decoder.0:backward",
        "embeddings:backward+global_norm+optimizer_step",
        "decoder.0:optimizer_step", "decoder.1:optimizer_step", "decoder.2:optimizer_step",
        "head:optimizer_step",
    ]  # fmt: skip


def test_loads_and_stores_follow_from_the_ops():
    forward = Phase("decoder", 0, (Op.FORWARD,))
    backward = Phase("decoder", 0, (Op.BACKWARD,))
    update = Phase("decoder", 0, (Op.OPTIMIZER_STEP,))
    fused = Phase("embeddings", None, (Op.BACKWARD, Op.GLOBAL_NORM, Op.OPTIMIZER_STEP))
    assert (forward.loads, forward.stores) == (("fwd",), ())
    assert (backward.loads, backward.stores) == (("fwd",), ("grad",))
    assert (update.loads, update.stores) == (("fwd", "optim", "grad"), ("fwd", "optim"))
    assert (fused.loads, fused.stores) == (("fwd", "optim"), ("fwd", "optim"))


def test_stages_order_phases_whatever_the_emission_order():
    program = StepProgram(1)
    program.emit(Stage.HEAD_OPTIMIZER, Phase("head", None, (Op.OPTIMIZER_STEP,)))
    program.emit(Stage.EMBEDDINGS_FORWARD, Phase("embeddings", None, (Op.FORWARD,)))
    assert [p.unit for p in program] == ["embeddings", "head"]


def _standard(layers=1, skip=None, extra=()):
    program = StepProgram(layers)
    phases = [
        (Stage.EMBEDDINGS_FORWARD, Phase("embeddings", None, (Op.FORWARD,))),
        *[(Stage.DECODER_FORWARD, Phase("decoder", n, (Op.FORWARD,))) for n in range(layers)],
        (Stage.HEAD_FORWARD_BACKWARD, Phase("head", None, (Op.LOSS_BACKWARD,))),
        *[(Stage.DECODER_BACKWARD, Phase("decoder", n, (Op.BACKWARD,))) for n in reversed(range(layers))],
        (Stage.EMBEDDINGS_BACKWARD_OPTIMIZER, Phase("embeddings", None, (Op.BACKWARD, Op.GLOBAL_NORM, Op.OPTIMIZER_STEP))),
        *[(Stage.DECODER_OPTIMIZER, Phase("decoder", n, (Op.OPTIMIZER_STEP,))) for n in range(layers)],
        (Stage.HEAD_OPTIMIZER, Phase("head", None, (Op.OPTIMIZER_STEP,))),
        *extra,
    ]
    for i, (stage, phase) in enumerate(phases):
        if i != skip:
            program.emit(stage, phase)
    return program


def test_standard_program_is_valid():
    _standard(layers=2).validate()


@pytest.mark.parametrize(
    ("skip", "extra", "message"),
    [
        (1, (), r"head:loss_backward: x\[1\] has not been computed"),
        (3, (), r"embeddings:backward\+global_norm\+optimizer_step: dx\[0\] has not been computed"),
        (5, (), "never updates decoder.0"),
        (None, [(Stage.HEAD_OPTIMIZER, Phase("head", None, (Op.OPTIMIZER_STEP,)))], "head is updated twice"),
        (None, [(Stage.HEAD_OPTIMIZER, Phase("head", None, (Op.GLOBAL_NORM,)))], "global norm is finished twice"),
    ],
)
def test_invalid_programs_are_refused(skip, extra, message):
    with pytest.raises(PluginError, match=message):
        _standard(layers=1, skip=skip, extra=extra).validate()


def test_optimizer_before_norm_is_refused():
    program = StepProgram(0)
    program.emit(Stage.EMBEDDINGS_FORWARD, Phase("embeddings", None, (Op.FORWARD, Op.OPTIMIZER_STEP)))
    with pytest.raises(PluginError, match="optimizer step runs before the global norm"):
        program.validate()


def test_norm_must_cover_every_gradient():
    program = StepProgram(0)
    program.emit(Stage.EMBEDDINGS_FORWARD, Phase("embeddings", None, (Op.FORWARD,)))
    program.emit(Stage.HEAD_FORWARD_BACKWARD, Phase("head", None, (Op.LOSS_BACKWARD, Op.GLOBAL_NORM)))
    with pytest.raises(PluginError, match=r"misses the gradients of \['embeddings'\]"):
        program.validate()


def test_layer_out_of_range_is_refused():
    with pytest.raises(PluginError, match="names layer 4 of a 2-layer model"):
        StepProgram(2).emit(Stage.DECODER_FORWARD, Phase("decoder", 4, (Op.FORWARD,)))
