"""A preference run's reference: the starting model's log-probability of every row, without a second model.

DPO and IPO compare the model's log-probabilities of each pair with the starting model's. Rather than keep a
second copy of the model (the peers' ``ref_model``; TRL's ``precompute_ref_log_probs`` computes them once), the
run computes them once, before its first step, by a forward-only pass of the engine's own model (layer-major,
one micro-batch at a time, as the evaluation runs: :class:`~ipuft.engine.inference.LayerMajor`; the head by
chunks of tokens, as in training), over the training rows and the validation rows. With ``model.adapter=lora``
the adapters start at zero (``B = 0``), so that this model is the base model. The log-probabilities are stored
in :data:`~ipuft.io.checkpoint.REFERENCE`, which every checkpoint of the run carries (checksummed by its
manifest) with each dataset's fingerprint (:meth:`~ipuft.data.preference.PreferenceDataset.fingerprint`): a
resumed run reads them and never computes them again (its model has trained since), and a dataset changed under
the run is refused. SimPO has no reference.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ipuft.engine.inference import LayerMajor
from ipuft.errors import CheckpointError, DataError
from ipuft.io.checkpoint import REFERENCE, read_verified
from ipuft.preference import SUMS, Pairs, PreferenceLoss, metrics, preference_pairs, summed

FORMAT = "ipuft-reference"


def row_logps(model, dataset, micro_batch_size: int, spec: PreferenceLoss) -> torch.Tensor:
    """Each row's summed completion log-probability under ``model`` (float32, on the host), in the order of
    ``dataset.eval_batches`` (row ``k`` of the dataset), forward only. Every rank computes every row (its TP
    group together)."""
    runner, out = LayerMajor(model), []
    for batch in dataset.eval_batches(micro_batch_size):
        for mb in range(batch.micro_batches):
            pairs = Pairs(spec, torch.zeros(batch.input_ids.shape[1]))
            with preference_pairs(pairs):
                runner.loss_sum(batch.input_ids[mb], batch.labels[mb])
            out.append(torch.cat(pairs.logps).float().cpu())
    logps = torch.cat(out)
    if logps.numel() != len(dataset) or not bool(torch.isfinite(logps).all()):
        raise DataError(f"{dataset.name}: the reference pass gave {logps.numel()} finite log-probabilities of "
                        f"{len(dataset)} rows")
    return logps


def preference_scores(model, dataset, micro_batch_size: int, spec: PreferenceLoss) -> dict[str, float]:
    """``{"loss", "pairs", TRL's metrics}`` over every pair of ``dataset`` once (its ``reference`` set), layer-major
    as :func:`~ipuft.engine.inference.dataset_loss`, each DP replica its share of the micro-batches."""
    layout, runner, records = model.layout, LayerMajor(model), []
    for batch in dataset.eval_batches(micro_batch_size, layout.dp_rank, layout.data_parallel):
        for mb in range(batch.micro_batches):
            pairs = Pairs(spec, batch.reference[mb])
            with preference_pairs(pairs):
                runner.loss_sum(batch.input_ids[mb], batch.labels[mb])
            records.extend(pairs.sums)
    total = summed(records, model.device)
    if layout.data_parallel > 1:
        dist.all_reduce(total, group=layout.dp_group)
    n = max(float(total[SUMS.index("pairs")]), 1.0)
    return {"loss": float(total[SUMS.index("loss")]) / n, **metrics(total), "pairs": int(n)}


def prepare_reference(cfg, model, data, validation, resumed: Path | None, files: dict[str, bytes]) -> None:
    """Set ``data.reference`` (and ``validation.reference``) for a preference run whose loss has a reference: from
    the ``resumed`` checkpoint's :data:`REFERENCE`, checked against the datasets' fingerprints, else by the
    reference pass of ``model`` now; and add the file to ``files``, which every checkpoint carries."""
    spec = PreferenceLoss.of(cfg)
    if spec is None or not spec.uses_reference:
        return
    sets = {"train": data, **({"validation": validation} if validation is not None else {})}
    if resumed is not None:
        limit = 4 * sum(len(d) for d in sets.values()) + (1 << 16)
        raw = read_verified(resumed, REFERENCE, limit) if (resumed / REFERENCE).is_file() else None
        if raw is None:
            raise CheckpointError(f"checkpoint.load: {resumed} has no {REFERENCE}, the reference log-probabilities a "
                                  f"{spec.kind} run resumes with; resume a checkpoint of a preference run")
        stored, meta = _read(raw, resumed)
        for name, dataset in sets.items():
            if meta.get(name) != dataset.fingerprint() or name not in stored \
                    or stored[name].numel() != len(dataset):
                raise DataError(f"checkpoint.load: the {name} rows ({dataset.name}) are not those {resumed}'s "
                                f"reference log-probabilities were computed for (the data changed under the run); "
                                f"resume with the run's data, or start a new run")
            dataset.reference = stored[name]
        files[REFERENCE] = raw
        return
    for dataset in sets.values():
        dataset.reference = row_logps(model, dataset, cfg.execution.micro_batch_size, spec)
    meta = {"format": FORMAT, **{name: d.fingerprint() for name, d in sets.items()}}
    files[REFERENCE] = save_safetensors({name: d.reference.contiguous() for name, d in sets.items()}, metadata=meta)


def _read(raw: bytes, checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a :data:`REFERENCE` file's bytes, checked: float32 vectors of finite values."""
    import json

    where = f"checkpoint {checkpoint}: {REFERENCE}"
    try:
        header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        tensors = load_safetensors(raw)
    except (ValueError, SafetensorError) as exc:  # a file the manifest vouches for, but not of this format
        raise CheckpointError(f"{where} is not a safetensors file ({str(exc)[:80]})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not an ipuft reference file (its metadata format is not {FORMAT})")
    for name, t in tensors.items():
        if t.dtype != torch.float32 or t.dim() != 1 or not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{where}: {name} must be a float32 vector of finite log-probabilities")
        if name not in ("train", "validation"):
            raise CheckpointError(f"{where} holds {name[:40]!r}; only train and validation")
    return tensors, meta

