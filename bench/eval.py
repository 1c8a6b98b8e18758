"""Batched ``eval --task mnli`` on the shipped 300-row MNLI sample, against the same evaluation one row at a
time, in one process.

    python bench/eval.py [--batch-size N] [--rows N] [--repeats R] [KEY=VALUE ...]

Both modes (``score``: label log-likelihoods; ``generate``: greedy decoding of the label) run through the
layer-major inference engine with weights offloaded (one unit on the device at a time), on a random
small-cpu-sized model with the shipped 512-token tokenizer (accuracy is not the point). Prints the tokens/s
of each batch size and the ratio batched / one row at a time, each the median of alternated rounds, since
these machines are noisy. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from importlib import resources
from pathlib import Path

from ipuft.config import load_config
from ipuft.plugins import create_plugin_manager
from ipuft.run.evaluate import evaluate_mnli

DEFAULTS = ["data.path=mnli-sample", "data.tokenizer=sample", "model.sequence_length=128", "execution.offload=true",
            "execution.device=cpu"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    hooks = create_plugin_manager()
    rows = (resources.files("ipuft.sample_data") / "mnli_sample.jsonl").read_text().splitlines()[: args.rows]
    with tempfile.TemporaryDirectory() as tmp:
        subset = Path(tmp) / "rows.jsonl"
        subset.write_text("\n".join(rows) + "\n")
        cfg = load_config("small-cpu", [*DEFAULTS, f"data.path={subset}", *args.overrides],
                          hooks.registrations.config_sections)
        report = {"rows": len(rows), "batch_size": args.batch_size}
        for mode in ("score", "generate"):
            rates: dict[int, list[float]] = {1: [], args.batch_size: []}
            results = {}
            for _ in range(args.repeats):
                for size in rates:  # alternated, so that drifting machine load hits both alike
                    results[size] = evaluate_mnli(cfg, hooks, mode, size)
                    rates[size].append(results[size]["tokens_per_s"])
            assert results[1]["correct"] == results[args.batch_size]["correct"], "batched and single rows disagree"
            one, batched = statistics.median(rates[1]), statistics.median(rates[args.batch_size])
            report[mode] = {"tokens_per_s_one_row": round(one, 1), "tokens_per_s_batched": round(batched, 1),
                            "ratio": round(batched / one, 2),
                            "device_peak_bytes_batched": results[args.batch_size]["device_peak_bytes"]}
            print(f"{mode:>8}: one row at a time {one:9.1f} tokens/s   {args.batch_size} rows together "
                  f"{batched:9.1f} tokens/s   ratio {batched / one:5.2f}x", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
