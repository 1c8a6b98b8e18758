"""Preference tuning (#40) on the phased engine: DPO, IPO and SimPO (with and without the SFT term) against a plain
reference loop written here (transformers' logits, each pair's loss by hand, torch's AdamW after global-norm
clipping), the head's loss whole and by chunks of tokens; GA=4 equals GA=1 on the same pairs; the reference
pass equals transformers' log-probabilities of each row."""

from __future__ import annotations

import dist_workers
import pytest
import torch
import torch.nn.functional as F
from distributed import spawn
from hf_reference import hf_state
from llama_reference import hf_model, save_hf
from test_engine import max_rel

from ipuft.components import IGNORE_INDEX
from ipuft.config import load_config
from ipuft.data.batch import Batch
from ipuft.preference import METRICS
from ipuft.run.runtime import build_engine

SEQ = 16
PAIRS = 4  # a step's pairs: 8 rows


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return save_hf(tmp_path_factory.mktemp("pref") / "llama", "llama", seed=3)[1]


def pair_rows(seed: int, pairs: int = PAIRS) -> tuple[torch.Tensor, torch.Tensor]:
    """``2 · pairs`` rows of ``SEQ`` tokens: pair ``i``'s chosen and rejected completions (rows ``2i``,
    ``2i + 1``) of one prompt, of unequal lengths, the prompt and the padding out of the loss."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(2 * pairs, SEQ, dtype=torch.long)
    labels = torch.full((2 * pairs, SEQ), IGNORE_INDEX, dtype=torch.long)
    for i in range(pairs):
        prompt = torch.randint(3, 101, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
        for j in range(2):
            completion = torch.randint(3, 101, (int(torch.randint(1, SEQ + 1 - len(prompt), (1,), generator=g)),),
                                       generator=g)
            row = torch.cat([prompt, completion])
            ids[2 * i + j, : min(len(row), SEQ)] = row[:SEQ]
            targets = row[1:]
            trained = torch.arange(1, len(row)) >= len(prompt)
            labels[2 * i + j, : len(targets)] = torch.where(trained, targets, IGNORE_INDEX)
    return ids, labels


def row_logps(model, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed completion log-probability under ``model`` (transformers' logits, by hand), and its
    completion's token count."""
    logits = model(ids).logits
    logits = logits if logits.dtype == torch.float64 else logits.float()
    logp = torch.log_softmax(logits, -1)
    keep = labels != IGNORE_INDEX
    token = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1) * keep
    return token.sum(-1), keep.sum(-1)


def pair_losses(kind: str, beta: float, gamma: float, sft: float, logp, count, ref):
    """Each pair's loss, written out from the papers' formulas (TRL's forms)."""
    nll = -logp[0::2] / count[0::2]
    if kind == "dpo":
        loss = -F.logsigmoid(beta * ((logp[0::2] - ref[0::2]) - (logp[1::2] - ref[1::2])))
    elif kind == "ipo":  # the log-ratios per completion token (TRL's, the IPO authors')
        loss = ((logp[0::2] - ref[0::2]) / count[0::2] - (logp[1::2] - ref[1::2]) / count[1::2] - 1 / (2 * beta)) ** 2
    else:  # SimPO: the mean log-probabilities
        loss = -F.logsigmoid(beta * (logp[0::2] / count[0::2] - logp[1::2] / count[1::2]) - gamma)
    return loss + sft * nll


def cfg_of(hooks, src, kind, micro, *extra):
    return load_config(None, [f"model.hf_checkpoint={src}", f"model.sequence_length={SEQ}", "data.format=preference",
                              f"training.preference.loss={kind}", "training.preference.beta=0.5",
                              f"training.global_batch_size={2 * PAIRS}", f"execution.micro_batch_size={micro}",
                              "training.optimizer.gradient_clipping=0.3", "plugins.adamw.weight_decay=0.1",
                              "plugins.adamw.eps=1e-6", *extra], hooks.registrations.config_sections)


# (loss, SFT weight, head chunk tokens, head vocabulary slices): the head whole, by chunks, and its weight's
# gradient by vocabulary slices (the tokens' weights deferred to the slices' pass).
# The last: the layer-boundary activations spilled to disk (execution.activation_offload=disk).
CASES = [("dpo", 0.0, 0, 0, False), ("dpo", 0.0, 5, 0, False), ("ipo", 0.0, 5, 0, False), ("simpo", 0.0, 5, 0, False),
         ("dpo", 0.7, 5, 0, False), ("dpo", 0.0, 5, 3, False), ("ipo", 0.3, 5, 0, True)]


@pytest.mark.parametrize("kind,sft,chunk,slices,disk", CASES)
def test_three_steps_equal_a_plain_reference_loop(hooks, src, tmp_path, kind, sft, chunk, slices, disk):
    """Three steps (GA=2, clipping active, decay) of the engine and of transformers + torch AdamW with the loss
    written by hand: losses within 1e-5, the gradient norm within 1e-5, TRL's metrics within 1e-5 of the
    reference's, and every weight within 1e-5 (float32 rounding of sums over 101 logits and 16 tokens)."""
    cfg = cfg_of(hooks, src, kind, 4, f"training.preference.sft_weight={sft}", f"execution.head_chunk_tokens={chunk}",
                 f"execution.head_vocab_slices={slices}", "training.steps=3",
                 *(["execution.activation_offload=disk", f"execution.spill_dir={tmp_path}"] if disk else []))
    engine = build_engine(cfg, hooks)
    hf = hf_model("llama", seed=3)
    beta, gamma = 0.5, cfg.training.preference.simpo_gamma
    groups = [{"params": [p for n, p in hf.named_parameters() if ("norm" in n or "bias" in n) == bare],
               "weight_decay": 0.0 if bare else 0.1} for bare in (False, True)]  # ipuft's adamw: no decay there
    adam = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-6)
    for step in range(3):
        ids, labels = pair_rows(step)
        with torch.no_grad():  # the reference: the starting model (here, the model before each step's update)
            ref = row_logps(hf_model("llama", seed=3), ids, labels)[0] if kind != "simpo" else torch.zeros(len(ids))
        batch = Batch(ids.view(2, 4, SEQ), labels.view(2, 4, SEQ), reference=ref.view(2, 4))
        result = engine.step(batch, 1e-3)
        adam.zero_grad()
        logp, count = row_logps(hf, ids, labels)
        losses = pair_losses(kind, beta, gamma, sft, logp, count, ref)
        losses.mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), 0.3).item()
        adam.step()
        assert abs(result.loss - losses.mean().item()) <= 1e-5 * abs(losses.mean().item()), step
        assert abs(result.grad_norm - norm) <= 1e-5 * norm and norm > 0.3, step
        means = logp / count if kind == "simpo" else logp
        rewards = beta * (means - (0 if kind == "simpo" else ref))
        expect = {"rewards/chosen": rewards[0::2].mean(), "rewards/rejected": rewards[1::2].mean(),
                  "rewards/margins": (rewards[0::2] - rewards[1::2]).mean(),
                  "rewards/accuracies": (rewards[0::2] > rewards[1::2]).float().mean(),
                  "logps/chosen": means[0::2].mean(), "logps/rejected": means[1::2].mean()}
        assert set(result.metrics) == set(METRICS)
        for name, value in expect.items():
            assert abs(result.metrics[name] - value.item()) <= 1e-5 * max(1.0, abs(value.item())), (step, name)
    ours = hf_state(engine.modules, 2, engine.model.full_weights())
    for name, p in hf.named_parameters():
        assert max_rel(ours[name], p.detach()) <= 1e-5, name


@pytest.mark.parametrize("chunk", [0, 3])
def test_ga4_equals_ga1_on_the_same_pairs(hooks, src, chunk):
    """The same eight rows as GA=4 × one pair and GA=1 × four pairs: loss, norm, metrics and every weight after
    two steps within float32 rounding (the step's loss is the mean over its pairs whatever the micro-batching)."""
    runs = {}
    for micro in (2, 8):
        cfg = cfg_of(hooks, src, "dpo", micro, f"execution.head_chunk_tokens={chunk}", "training.steps=2")
        engine = build_engine(cfg, hooks)
        ga = 2 * PAIRS // micro
        results = []
        for step in range(2):
            ids, labels = pair_rows(10 + step)
            ref = torch.linspace(-30.0, -10.0, 2 * PAIRS)
            results.append(engine.step(Batch(ids.view(ga, micro, SEQ), labels.view(ga, micro, SEQ),
                                             reference=ref.view(ga, micro)), 2e-3))
        runs[micro] = results, engine.model.full_weights()
    (four, w4), (one, w1) = runs[2], runs[8]
    for a, b in zip(four, one, strict=True):
        assert abs(a.loss - b.loss) <= 1e-6 * abs(b.loss) and abs(a.grad_norm - b.grad_norm) <= 1e-5 * b.grad_norm
        for name in METRICS:
            assert abs(a.metrics[name] - b.metrics[name]) <= 1e-5 * max(1.0, abs(b.metrics[name])), name
    for unit, w in w1.items():
        for n, t in w.items():
            assert max_rel(w4[unit][n], t) <= 1e-5, f"{unit}.{n}"


def step_batch(step: int, micro: int, rank: int = 0, replicas: int = 1) -> Batch:
    """DP rank ``rank``'s share of step ``step``'s eight rows (micro-batches ``rank, rank + replicas, ...``), each
    row's reference log-prob a fixed value."""
    ids, labels = pair_rows(20 + step)
    ref = torch.linspace(-30.0, -10.0, 2 * PAIRS)
    return Batch(*(t.view(-1, micro, *t.shape[1:])[rank::replicas] for t in (ids, labels)),
                 reference=ref.view(-1, micro)[rank::replicas])


def test_tensor_and_data_parallel_equal_one_process(hooks, src, tmp_path):
    """DPO at TP=2 (the head's vocabulary split: each token's cross-entropy reduced over the group, whole and by
    chunks) and DP=2 with RTS (each replica two pairs): the reference pass on every rank within 1e-6 of one
    process's, three steps' losses, norms and metrics within 1e-5, every weight within 1e-5, and every rank's
    traffic its plan."""
    from ipuft.run.reference import row_logps as reference_pass

    common = [f"model.hf_checkpoint={src}", f"model.sequence_length={SEQ}", "data.format=preference",
              f"training.global_batch_size={2 * PAIRS}", "training.optimizer.gradient_clipping=0.3",
              "plugins.adamw.eps=1e-4", "training.preference.sft_weight=0.2"]  # (eps: as test_llama's layouts)
    configs = {"tp2": [*common, "execution.tensor_parallel=2", "execution.micro_batch_size=4"],
               "tp2_chunks": [*common, "execution.tensor_parallel=2", "execution.micro_batch_size=4",
                              "execution.head_chunk_tokens=5"],
               "dp2_rts": [*common, "execution.data_parallel=2", "execution.rts=true", "execution.micro_batch_size=2"]}
    spawn(2, dist_workers.preference_steps, configs, 3, str(tmp_path), tmp=tmp_path)
    for name, overrides in configs.items():
        single = [o for o in overrides if not o.startswith(("execution.tensor_parallel", "execution.data_parallel",
                                                            "execution.rts"))]
        cfg = load_config(None, single, hooks.registrations.config_sections)
        engine = build_engine(cfg, hooks)
        reference = reference_pass(engine.model, Rows(*pair_rows(5, pairs=5)), 4, engine.preference)
        results = [engine.step(step_batch(s, cfg.execution.micro_batch_size), 2e-3) for s in range(3)]
        got = torch.load(tmp_path / f"{name}.rank0.pt")
        for a, b in zip(got["losses"], results, strict=True):
            assert abs(a - b.loss) <= 1e-5 * abs(b.loss), name
        for a, b in zip(got["norms"], results, strict=True):
            assert abs(a - b.grad_norm) <= 1e-5 * b.grad_norm and b.grad_norm > 0.3, name
        for a, b in zip(got["metrics"], results, strict=True):
            for key in METRICS:
                assert abs(a[key] - b.metrics[key]) <= 1e-5 * max(1.0, abs(b.metrics[key])), (name, key)
        for unit, w in engine.model.full_weights().items():
            for n, t in w.items():
                assert max_rel(got["weights"][unit][n], t) <= 1e-5, f"{name} {unit}.{n}"
        for rank in range(2):
            mine = torch.load(tmp_path / f"{name}.rank{rank}.pt")
            assert mine["traffic"] == mine["planned"], (name, rank)
            assert torch.allclose(mine["reference"], reference, rtol=1e-6, atol=0), (name, rank)


def peft_dpo_steps(model, engine=None) -> list[tuple]:
    """Three DPO steps of peft's ``model`` (and of ``engine``, if given) on :func:`pair_rows`: per step the
    engine's result (or None) and the reference loop's loss, norm and reward margin."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    adam = torch.optim.AdamW(trainable, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1)
    dtype = next(model.parameters()).dtype
    out = []
    for step in range(3):
        ids, labels = pair_rows(step)
        with torch.no_grad():
            ref = row_logps(hf_model("llama", seed=3).to(dtype), ids, labels)[0]
        result = None if engine is None else engine.step(
            Batch(ids.view(2, 4, SEQ), labels.view(2, 4, SEQ), reference=ref.float().view(2, 4)), 1e-3)
        adam.zero_grad()
        logp, count = row_logps(model, ids, labels)
        losses = pair_losses("dpo", 0.5, 0.0, 0.0, logp, count, ref)
        losses.mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(trainable, 0.3).item()
        adam.step()
        rewards = 0.5 * (logp - ref)
        out.append((result, losses.mean().item(), norm, (rewards[0::2] - rewards[1::2]).mean().item()))
    return out


def test_lora_dpo_equals_peft_with_the_same_loop(hooks, src):
    """LoRA on every projection: three DPO steps (GA=2, clipping active, decay) of the engine and of peft's LoRA
    with the same initial adapters, the same pairs and the loss written by hand: losses, norms and the reward
    margin within 1e-5; every adapter as near peft's in float64 as peft's own in float32 is (test_lora's bound:
    Adam divides near-cancelling moments, so float32 rounding comes back as whole relative differences), and the
    base untouched. The reference is the starting model, which with B = 0 is the base."""
    from test_lora import LLAMA_MODULES, adapters, lora, peft_model

    cfg = cfg_of(hooks, src, "dpo", 4, "training.steps=3", *lora("q", "k", "v", "o", "gate", "up", "down"))
    engine = build_engine(cfg, hooks)
    base = {u: {n: t.clone() for n, t in w.items()} for u, w in engine.model.full_weights().items()}
    exact = peft_model(hf_model("llama", seed=3).double(), LLAMA_MODULES, engine)
    peft_dpo_steps(exact)
    model = peft_model(hf_model("llama", seed=3), LLAMA_MODULES, engine)
    for step, (result, loss, norm, margin) in enumerate(peft_dpo_steps(model, engine)):
        assert abs(result.loss - loss) <= 1e-5 * abs(loss), step
        assert abs(result.grad_norm - norm) <= 1e-5 * norm and norm > 0.3, step
        assert abs(result.metrics["rewards/margins"] - margin) <= 1e-5, step

    def named(m):
        return {n.replace(".default.", "."): p.detach() for n, p in m.named_parameters() if p.requires_grad}

    theirs, truth = named(model), named(exact)
    peft_error = max(max_rel(theirs[n].double(), truth[n]) for n in truth)
    for name, t in adapters(engine).items():
        assert max_rel(t.double(), truth[name]) <= 1.5 * peft_error, name
    for unit, w in engine.model.full_weights().items():
        for n, t in w.items():
            if "lora" not in n:
                assert torch.equal(t, base[unit][n]), f"{unit}.{n}"


def test_bfloat16_with_stochastic_rounding_equals_a_plain_bfloat16_reference(hooks, src):
    """DPO in bfloat16 with stochastic rounding (the head by chunks, GA=4, clipping active): the engine against
    test_precision's plain bfloat16 autograd reference of the same modules, its head under the same pairs, with
    the same rounding bits, within the bounds :func:`test_precision.assert_16bit_close` justifies."""
    from test_precision import BF16_SR, assert_16bit_close, plain_16bit_reference

    from ipuft.preference import Pairs, preference_pairs
    from ipuft.run.schedule import learning_rate

    cfg = cfg_of(hooks, src, "dpo", 2, "training.steps=3", "execution.head_chunk_tokens=5", "execution.loss_scaling=64",
                 "training.optimizer.learning_rate.maximum=3e-3", *BF16_SR)
    engine = build_engine(cfg, hooks)
    initial = {u: {n: t.clone() for n, t in w.items()} for u, w in engine.model.weights().items()}
    step_batches = [step_batch(s, 2) for s in range(3)]
    results = [engine.step(b, learning_rate(s, 3, cfg.training.optimizer.learning_rate))
               for s, b in enumerate(step_batches)]

    def head(batch, mb):
        return preference_pairs(Pairs(engine.preference, batch.reference[mb]))

    expected = plain_16bit_reference(cfg, engine.modules, initial, step_batches, head=head)
    float32 = plain_16bit_reference(cfg, engine.modules, {u: {n: t.float() for n, t in w.items()}
                                                          for u, w in initial.items()}, step_batches, head=head)[2]
    assert results[0].grad_norm > 0.3
    assert_16bit_close(cfg, results, engine.model.weights(), expected, float32, torch.bfloat16)


class Rows:
    """A stand-in for preference data's evaluation order: ``ids``/``labels`` rows in micro-batches."""

    name = "rows"

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor) -> None:
        self.ids, self.labels, self.reference = ids, labels, None

    def __len__(self) -> int:
        return len(self.ids)

    def eval_batches(self, micro: int, replica: int = 0, replicas: int = 1):
        for start in range(replica * micro, len(self), micro * replicas):
            rows = slice(start, start + micro)
            ref = torch.zeros(len(self))[rows] if self.reference is None else self.reference[rows]
            yield Batch(self.ids[rows][None], self.labels[rows][None], reference=ref[None])


@pytest.mark.parametrize("adapter,chunk", [(False, 0), (False, 7), (True, 512)])
def test_the_reference_pass_equals_transformers_log_probs(hooks, src, adapter, chunk):
    """The reference pass (forward only, layer-major, micro-batches of 4 rows and a last one of 2; the head whole
    or by chunks of 7 tokens) gives each row's summed completion log-probability as transformers' logits do,
    within 1e-5; with LoRA the base's (the adapters start at B = 0)."""
    from test_lora import lora

    from ipuft.run.reference import row_logps as reference_pass

    cfg = cfg_of(hooks, src, "dpo", 4, f"execution.head_chunk_tokens={chunk}",
                 *(lora("q", "v", "down") if adapter else ()))
    engine = build_engine(cfg, hooks)
    ids, labels = pair_rows(5, pairs=5)
    got = reference_pass(engine.model, Rows(ids, labels), 4, engine.preference)
    with torch.no_grad():
        want = row_logps(hf_model("llama", seed=3), ids, labels)[0]
    assert got.shape == (10,) and torch.allclose(got, want, rtol=1e-5, atol=0), (got - want).abs().max()


def tokenized_pairs(path, pairs: int = 6, seed: int = 0):
    """``pairs`` pre-tokenized rows (TRL's ``*_input_ids`` columns) written to ``path`` as JSON lines."""
    import json

    g = torch.Generator().manual_seed(seed)

    def ids(low, high):
        return torch.randint(3, 101, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()

    rows = [{"prompt_input_ids": ids(2, 6), "chosen_input_ids": ids(1, 8) + [2], "rejected_input_ids": ids(1, 8) + [2]}
            for _ in range(pairs)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def run_train(hooks, src, data, out, *extra):
    from ipuft.run.train import train

    cfg = load_config(None, [f"model.hf_checkpoint={src}", f"model.sequence_length={SEQ}", f"data.path={data}",
                             "data.format=preference", "data.packing=false", "training.global_batch_size=4",
                             "execution.micro_batch_size=2", "training.optimizer.learning_rate.maximum=1e-3",
                             f"output_dir={out}", *extra], hooks.registrations.config_sections)
    return train(cfg, hooks, progress=False)


def test_a_run_records_trls_metrics_and_resumes_bit_exact_with_its_reference(hooks, src, tmp_path):
    """A DPO run from pre-tokenized rows: each step's record has TRL's metrics; the reference pass's log-probs are
    transformers' of each row and travel in every checkpoint (checksummed); a run resumed from its step-2
    checkpoint reads them (the pass is not run again: its model has trained) and ends bit-identical to the
    uninterrupted run; the same checkpoint with a changed dataset is refused in one line, writing nothing."""
    from safetensors.torch import load_file

    from ipuft.errors import DataError
    from ipuft.io.checkpoint import REFERENCE, verify
    from ipuft.run import reference

    data = tmp_path / "pairs.jsonl"
    rows = tokenized_pairs(data)
    full = run_train(hooks, src, data, tmp_path / "full", "training.steps=4")
    assert [sorted(set(METRICS) - set(r)) for r in full] == [[]] * 4 and abs(full[0]["rewards/margins"]) < 1e-5
    crashed = run_train(hooks, src, data, tmp_path / "crashed", "training.steps=4", "checkpoint.steps=2")
    assert [r["loss"] for r in crashed] == [r["loss"] for r in full]
    step2 = tmp_path / "crashed" / "checkpoints" / "step-00000002"
    verify(step2)
    stored = load_file(str(step2 / REFERENCE))["train"]
    hf = hf_model("llama", seed=3)
    with torch.no_grad():
        for k, row in enumerate(rows):
            prompt = row["prompt_input_ids"]
            for j, completion in enumerate((row["chosen_input_ids"], row["rejected_input_ids"])):
                ids = torch.tensor([prompt + completion])
                logp = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1)
                want = logp[torch.arange(len(prompt) - 1, ids.shape[1] - 1), ids[0, len(prompt):]].sum()
                assert abs(stored[2 * k + j] - want) <= 1e-5 * abs(want), (k, j)
    calls = []
    original = reference.row_logps
    reference.row_logps = lambda *a: calls.append(a) or original(*a)
    try:
        resumed = run_train(hooks, src, data, tmp_path / "resumed", "training.steps=4", f"checkpoint.load={step2}")
    finally:
        reference.row_logps = original
    assert calls == [] and [r["step"] for r in resumed] == [3, 4]
    for key in ("loss", "grad_norm", *METRICS):
        assert [r[key] for r in resumed] == [r[key] for r in full[2:]], key
    a, b = (load_file(str(d / "checkpoints" / "step-00000004" / "model.safetensors")) for d in
            (tmp_path / "full", tmp_path / "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    changed = tmp_path / "changed.jsonl"
    tokenized_pairs(changed, seed=1)
    with pytest.raises(DataError, match=r"^checkpoint.load: the train rows .* are not those .*reference log-prob"):
        run_train(hooks, src, changed, tmp_path / "refused", "training.steps=4", f"checkpoint.load={step2}")
    assert not (tmp_path / "refused").exists()


def test_simpo_runs_without_a_reference(hooks, src, tmp_path):
    """SimPO is reference-free: no reference pass, no reference file in its checkpoints, and its records carry
    TRL's metrics of the length-normalised log-probabilities."""
    from ipuft.io.checkpoint import REFERENCE

    data = tmp_path / "pairs.jsonl"
    tokenized_pairs(data)
    records = run_train(hooks, src, data, tmp_path / "run", "training.steps=2", "training.preference.loss=simpo")
    assert all(r["logps/chosen"] > -10 for r in records)  # a mean over tokens of 101: about -log(101) = -4.6
    assert not (tmp_path / "run" / "checkpoints" / "step-00000002" / REFERENCE).exists()


def test_the_plan_counts_the_reference_pass_and_its_bytes(hooks, src, capsys):
    """``ipuft plan`` of a DPO run shows its reference pass (its micro-batches, 4 bytes a row kept) and counts each
    row's reference log-prob in a step's data traffic; SimPO has no pass."""
    import json

    from cli_helpers import run_cli

    base = [f"model.hf_checkpoint={src}", f"model.sequence_length={SEQ}", "data.format=preference",
            "training.global_batch_size=8", "execution.micro_batch_size=4"]
    code, out, _ = run_cli(capsys, "plan", *base, "--json")
    plan = json.loads(out)
    assert code == 0 and plan["reference_pass"] == {"micro_batch_size": 4, "host_bytes_per_row": 4}
    assert plan["traffic"]["h2d"]["data"] == 2 * 8 * SEQ * 8 + 8 * 4  # ids and labels (int64), a float32 a row
    code, out, _ = run_cli(capsys, "plan", *base)
    assert code == 0 and "reference pass:       once, before step 1: forward only over every row, 4 rows" in out
    code, out, _ = run_cli(capsys, "plan", *base, "training.preference.loss=simpo", "--json")
    assert code == 0 and json.loads(out)["reference_pass"] is None


def test_validation_rows_get_their_own_reference_and_trls_metrics(hooks, src, tmp_path):
    """With held-out pairs and learning rate 0 the model stays the starting one, so that on its validation rows
    (their reference computed by the same pass) each reward is 0 and the DPO loss log 2, within float32 rounding
    of the reference pass against the evaluation; a wrong or missing validation reference would give β · logp."""
    import math

    data = tmp_path / "pairs.jsonl"
    tokenized_pairs(data, pairs=8)
    records = run_train(hooks, src, data, tmp_path / "run", "training.steps=2", "training.eval_steps=1",
                        "data.validation_fraction=0.25", "training.optimizer.learning_rate.maximum=0.0")
    for r in records:
        assert r["validation_pairs"] == 2 and abs(r["validation_loss"] - math.log(2)) <= 1e-6
        for key in METRICS:
            assert abs(r[f"validation_{key}"]) <= (0 if key == "rewards/accuracies" else 1e-6) or "logps" in key, key
        assert r["validation_logps/chosen"] < -5 and abs(r["rewards/margins"]) <= 1e-6


def test_a_bad_pair_stops_the_run_in_one_line_and_writes_nothing(src, tmp_path, capsys):
    from cli_helpers import run_cli

    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt_input_ids": [5], "chosen_input_ids": [6], "rejected_input_ids": [6]}\n')
    code, _, err = run_cli(capsys, "train", f"model.hf_checkpoint={src}", f"model.sequence_length={SEQ}",
                           f"data.path={data}", "data.format=preference", "training.global_batch_size=2",
                           "execution.micro_batch_size=2", f"output_dir={tmp_path / 'run'}")
    assert code != 0 and err.splitlines()[-1] == (
        f"ipuft: error: {data} row 1: chosen_input_ids and rejected_input_ids are the same tokens; a pair prefers "
        "one of two")
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_a_checkpoint_without_config_takes_a_recipe_for_pairs(src, tmp_path, capsys):
    """No --config: the finetune recipe, with whole pairs in a micro-batch (its one row becomes two) and TRL's
    DPO learning rate instead of the SFT one, each said in the recipe line; the run trains and records TRL's
    metrics."""
    from cli_helpers import run_cli

    data = tmp_path / "pairs.jsonl"
    tokenized_pairs(data)
    code, _, err = run_cli(capsys, "train", f"model.hf_checkpoint={src}", f"data.path={data}",
                           "data.format=preference", "training.steps=1", "model.precision=float32",
                           f"output_dir={tmp_path / 'run'}")
    recipe = err.splitlines()[0]
    assert code == 0 and recipe.startswith("ipuft: recipe finetune"), err
    assert "execution.micro_batch_size=2 (whole pairs: two rows each)" in recipe
    assert "training.optimizer.learning_rate.maximum=1e-06 (TRL's DPOTrainer's" in recipe
    assert recipe.count("learning_rate.maximum") == 1
    import json

    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["lr"] <= 1e-6 and "rewards/accuracies" in record


def test_the_step_flops_count_the_heads_pre_pass(hooks):
    """The chunked head makes every token's loss once before the pairs' weights (one more logits matmul,
    2 · tokens · hidden · vocabulary FLOPs a micro-batch): the plan's FLOPs of a DPO step exceed the same
    step's on text data by exactly that (the work it does, not understated)."""
    from ipuft.engine.model import build_model
    from ipuft.plan.flops import step_flops

    flops = {}
    for fmt in ("text", "preference"):
        cfg = load_config("tiny", ["model.sequence_length=16", "training.global_batch_size=8",
                                   "execution.micro_batch_size=4", "model.embedding.vocab_size=101",
                                   f"data.format={fmt}"], hooks.registrations.config_sections)
        flops[fmt] = step_flops(cfg, build_model(cfg, hooks, hooks.registrations.build_optimizer(cfg))).model
    assert flops["preference"] - flops["text"] == 2 * (2 * 4 * 16 * cfg.model.hidden_size * 101)
