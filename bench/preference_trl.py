"""ipuft's DPO, IPO and SimPO against TRL's trainers on the same tiny Llama, the same pairs and the same recipe.

    pip install trl        # not a test extra: TRL and its dependencies would double the suite's install
    python bench/preference_trl.py [--steps N]

A random Llama (2 layers, hidden 48, 101 tokens) saved as a Hugging Face directory; eight pre-tokenized pairs of
unequal lengths; both sides take all eight pairs a step (so the order a sampler draws does not matter), AdamW
(lr 1e-3, no decay, eps 1e-8), global-norm clipping at 1.0, a constant schedule, float32 on the CPU. TRL's
DPOTrainer runs with ``precompute_ref_log_probs=True`` (the reference computed once, before training, as ipuft
computes it), its dataset given as its own tokenized columns (``prompt_ids``, ``chosen_ids``, ``rejected_ids``);
ipuft trains ``data.format=preference`` on the same rows as ``prompt_input_ids`` etc. SimPO is TRL's CPOTrainer
with ``loss_type="simpo"``. Prints, per loss and step, both losses and TRL's reward metrics, and the largest
relative difference of each over the steps. Not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from llama_reference import save_hf

from ipuft.config import load_config
from ipuft.plugins import create_plugin_manager
from ipuft.run.train import train

PAIRS, SEQ = 8, 24
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
        "logps/rejected")


def pairs() -> list[dict]:
    g = torch.Generator().manual_seed(0)

    def ids(low: int, high: int) -> list[int]:
        return torch.randint(3, 101, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()

    return [{"prompt_ids": [1] + ids(3, 9), "chosen_ids": ids(2, 12) + [2], "rejected_ids": ids(2, 12) + [2]}
            for _ in range(PAIRS)]


def ipuft_run(src: Path, rows: list[dict], kind: str, steps: int, work: Path, eps: float) -> list[dict]:
    data = work / f"{kind}.jsonl"
    data.write_text("".join(json.dumps({"prompt_input_ids": r["prompt_ids"], "chosen_input_ids": r["chosen_ids"],
                                        "rejected_input_ids": r["rejected_ids"]}) + "\n" for r in rows))
    hooks = create_plugin_manager()
    cfg = load_config(None, [f"model.hf_checkpoint={src}", f"model.sequence_length={SEQ}", f"data.path={data}",
                             "data.format=preference", "data.packing=false", "data.shuffle=false",
                             f"training.preference.loss={kind}", f"training.global_batch_size={2 * PAIRS}",
                             f"execution.micro_batch_size={2 * PAIRS}", f"training.steps={steps}",
                             "training.optimizer.learning_rate.maximum=1e-3",
                             "training.optimizer.gradient_clipping=1.0",
                             "plugins.adamw.weight_decay=0.0", f"plugins.adamw.eps={eps}", f"output_dir={work / kind}",
                             "checkpoint.save=null"], hooks.registrations.config_sections)
    return train(cfg, hooks, progress=False)


def trl_run(src: Path, rows: list[dict], kind: str, steps: int, work: Path, eps: float) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback

    seen: list[dict] = []

    class Logs(TrainerCallback):  # each step's logged loss and metrics (logging_steps=1)
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                seen.append({k: logs[k] for k in KEYS if k in logs})
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(src / "tokenizer.json"), eos_token="</s>",
                                        pad_token="</s>", bos_token="<s>", unk_token="<unk>")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    common = dict(output_dir=str(work / f"trl-{kind}"), per_device_train_batch_size=PAIRS, max_steps=steps,
                  learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                  adam_epsilon=eps, max_grad_norm=1.0, logging_steps=1, report_to="none", use_cpu=True,
                  save_strategy="no", seed=0, beta=0.1, max_length=SEQ + 1)
    dataset = Dataset.from_list(rows)
    if kind == "simpo":  # CPOTrainer tokenizes text itself (bos before the prompt, eos after each answer): the
        from trl.experimental.cpo import CPOConfig, CPOTrainer  # same ids, as words of the word-level tokenizer

        def words(ids: list[int]) -> str:
            return " ".join(f"w{i}" for i in ids)

        text = Dataset.from_list([{"prompt": words(r["prompt_ids"][1:]), "chosen": " " + words(r["chosen_ids"][:-1]),
                                   "rejected": " " + words(r["rejected_ids"][:-1])} for r in rows])
        common.pop("max_length")
        trainer = CPOTrainer(model=model, args=CPOConfig(loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.5,
                                                         max_length=SEQ + 1, **common),
                             train_dataset=text, processing_class=tokenizer, callbacks=[Logs()])
    else:
        from trl import DPOConfig, DPOTrainer

        DPOTrainer._prepare_dataset = lambda self, dataset, *a, **k: dataset  # the rows are its own columns
        trainer = DPOTrainer(model=model, args=DPOConfig(loss_type=["sigmoid" if kind == "dpo" else "ipo"],
                                                         precompute_ref_log_probs=True, **common),
                             train_dataset=dataset, processing_class=tokenizer, callbacks=[Logs()])
    trainer.train()
    return seen


def float64_logps(src: Path, rows: list[dict]) -> tuple[float, float]:
    """The mean summed completion log-probability of the chosen and of the rejected completions under the starting
    model, by transformers in float64: what step 1 of either side should report."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64)
    sums = [0.0, 0.0]
    with torch.no_grad():
        for r in rows:
            for j, key in enumerate(("chosen_ids", "rejected_ids")):
                ids = torch.tensor([r["prompt_ids"] + r[key]])
                logp = torch.log_softmax(model(ids).logits[0, :-1], -1)
                start = len(r["prompt_ids"])
                sums[j] += float(logp[torch.arange(start - 1, ids.shape[1] - 1), ids[0, start:]].sum())
    return sums[0] / len(rows), sums[1] / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--losses", default="dpo,ipo,simpo")
    parser.add_argument("--eps", type=float, default=1e-8, help="Adam's epsilon, both sides")
    args = parser.parse_args()
    import trl

    print(f"trl {trl.__version__}, torch {torch.__version__}, float32 on the CPU "
          f"({torch.backends.cpu.get_cpu_capability()})")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        src = save_hf(work / "llama", "llama", seed=3)[1]
        rows = pairs()
        truth = float64_logps(src, rows)
        print(f"transformers in float64, the starting model: logps/chosen {truth[0]:.6g}, logps/rejected "
              f"{truth[1]:.6g} (the step-1 values both sides report)")
        for kind in args.losses.split(","):
            try:
                theirs = trl_run(src, rows, kind, args.steps, work, args.eps)
            except Exception as exc:  # noqa: BLE001  (a TRL version without this trainer or option: say so)
                print(f"{kind}: TRL could not run it ({type(exc).__name__}: {str(exc)[:200]})")
                continue
            ours = ipuft_run(src, rows, kind, args.steps, work, args.eps)
            worst = dict.fromkeys(KEYS, 0.0)
            for step, (a, b) in enumerate(zip(ours, theirs, strict=False), 1):
                print(f"{kind} step {step}: " + ", ".join(
                    f"{k} {a[k]:.6g}/{b[k]:.6g}" for k in KEYS if k in b and k in a) + "  (ipuft/TRL)")
                for k in KEYS:
                    if k in a and k in b:
                        worst[k] = max(worst[k], abs(a[k] - b[k]) / max(abs(b[k]), 1e-3))
            print(f"{kind}: largest relative difference " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


if __name__ == "__main__":
    main()
