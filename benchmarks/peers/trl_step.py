"""One GRPO step with Hugging Face TRL's GRPOTrainer (CPU or CUDA), on a shared workload directory.

Run in the TRL venv (see ``benchmarks/peers/README.md``), not in the project's Python:

    /tmp/artifex-peers/trl/bin/python benchmarks/peers/trl_step.py --model-dir DIR \
        [--windows 5] [--max-retries 10] [--dtype bfloat16] [--grad-accum N] [--device cuda]
        [--gradient-checkpointing]

``DIR`` is written by ``benchmarks/hfdir.py`` (W1 or W2): TRL loads the same ``config.json`` +
``model.safetensors`` that ours loads (``GRPOTrainer(model=DIR)``: transformers'
``AutoModelForCausalLM`` for the policy and, from the same path, the reference), the tokenizer in
``DIR``, and the prompt ids of ``DIR/prompts.json`` (given as text that the tokenizer maps back to
exactly those ids; the checks below verify it). One step is ``num_prompts x num_generations``
completions of exactly ``completion_length`` tokens (``min_new_tokens``: the EOS logit is masked
until then), ``beta`` > 0 (reference forward), one AdamW update, no vLLM, on-policy
(``num_iterations=1``). Steps are timed as clean windows (``benchmarks/cleanwin.py``).

Prints a summary and, last, one line ``RESULT {json}`` that ``benchmarks/honest.py`` parses. The
run fails (exit 1) when a step did not do the workload's work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cleanwin
import torch
import transformers
import trl
from datasets import Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

_W: dict = {}  # workload.json of the directory


def toy_reward(completions, completion_ids, **kwargs):
    """The fraction of even token ids in each completion (the workloads' toy reward)."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that records, per step, generation time and what each batch held."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.w1_log: list[dict] = []
        self._ref_calls = 0
        if self.ref_model is not None:
            self.ref_model.register_forward_hook(self._count_ref)

    def _count_ref(self, module, inputs, output):
        self._ref_calls += 1

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        t0 = time.perf_counter()
        out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        self._gen_s = time.perf_counter() - t0
        self._prompt_lens = [len(p) for p in prompt_ids]
        self._prompt_keys = [tuple(p) for p in prompt_ids]
        return out

    def _generate_and_score_completions(self, inputs):
        self._ref_calls = 0
        t0 = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        rollout_s = time.perf_counter() - t0
        keys = self._prompt_keys
        g = _W["num_generations"]
        groups = [keys[i : i + g] for i in range(0, len(keys), g)]
        self.w1_log.append(
            {
                "generation_s": self._gen_s,
                "rollout_s": rollout_s,  # generation + reference forward + reward + advantages
                "completions": int(out["completion_ids"].shape[0]),
                "completion_lengths": sorted(set(out["completion_mask"].sum(1).tolist())),
                "completion_width": int(out["completion_ids"].shape[1]),
                "prompt_lengths": sorted(set(self._prompt_lens)),
                "unique_prompts": len(set(keys)),
                "prompt_keys": sorted(set(keys)),
                "groups_of_one_prompt": all(len(set(g)) == 1 for g in groups),
                "ref_logps": out.get("ref_per_token_logps") is not None,
                "ref_forward_calls": self._ref_calls,
                "old_logps": out.get("old_per_token_logps") is not None,
            }
        )
        return out


class StepTimer(TrainerCallback):
    """Times each optimizer step (on_step_begin -> on_step_end) as a clean-window candidate.

    Steps after the warm-up go to ``windows``; once it has enough clean ones (or its retry budget
    is spent) the callback stops training.
    """

    def __init__(self, windows: cleanwin.Windows, warmup: int):
        self.windows = windows
        self.warmup = warmup
        self.steps: list[dict] = []
        self._snap = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._snap = cleanwin.snapshot()

    def on_step_end(self, args, state, control, **kwargs):
        end = cleanwin.snapshot()
        rec = {
            "seconds": end[0] - self._snap[0],
            "other_cpu": cleanwin.other_fraction(self._snap, end),
        }
        self.steps.append(rec)
        if len(self.steps) > self.warmup:
            rec["clean"] = rec["other_cpu"] <= self.windows.threshold
            self.windows.records.append(rec)
            if self.windows.done():
                control.should_training_stop = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="workload directory (hfdir.py)")
    parser.add_argument("--windows", type=int, default=5, help="clean timed steps wanted")
    parser.add_argument("--max-retries", type=int, default=10, help="extra steps for noisy ones")
    parser.add_argument("--threshold", type=float, default=0.05)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the model's parameter and compute dtype (no autocast, as ours --dtype)",
    )
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="gradient_accumulation_steps: each optimizer step accumulates N slices of the "
        "generation batch (still one generation and one update per step; ours: "
        "ours_worker.py --microbatches N)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where TRL runs (cuda: use_cpu=False, the first GPU)",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="TRL's gradient_checkpointing (ours: ours_worker.py --remat)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    t_start = time.perf_counter()
    with open(os.path.join(args.model_dir, "workload.json")) as fh:
        _W.update(json.load(fh))
    with open(os.path.join(args.model_dir, "prompts.json")) as fh:
        prompts = json.load(fh)
    n_prompts, n_gen = _W["num_prompts"], _W["num_generations"]
    completion_len = _W["completion_length"]
    torch.set_num_threads(os.cpu_count() or 1)
    if prompts["text"] is None:
        # The word-level tokenizer of a random-weight directory (AutoTokenizer would pick the
        # model type's tokenizer class instead of tokenizer.json's).
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.model_dir)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.padding_side = "left"
    texts = prompts["text"] or [" ".join(f"t{i}" for i in row) for row in prompts["ids"]]
    want_keys = sorted(tuple(row) for row in prompts["ids"])
    dataset = Dataset.from_dict({"prompt": texts})
    windows = cleanwin.Windows(args.windows, args.max_retries, args.threshold)
    max_steps = args.warmup + args.windows + args.max_retries

    with tempfile.TemporaryDirectory(prefix="trl_step_") as tmp:
        batch = n_prompts * n_gen
        if args.grad_accum < 1 or batch % args.grad_accum:
            parser.error(f"--grad-accum must divide the batch of {batch} completions")
        config = GRPOConfig(
            output_dir=os.path.join(tmp, "out"),
            per_device_train_batch_size=batch // args.grad_accum,  # completions per slice
            generation_batch_size=batch,  # one generation batch per optimizer step
            gradient_accumulation_steps=args.grad_accum,
            num_generations=n_gen,
            max_completion_length=completion_len,
            generation_kwargs={"min_new_tokens": completion_len},  # no early stop
            temperature=1.0,
            beta=_W["beta"],
            num_iterations=1,
            loss_type="grpo",  # per-sequence token mean, as our GRPOConfig defaults
            learning_rate=_W["learning_rate"],
            optim="adamw_torch",
            max_steps=max_steps,
            use_vllm=False,
            use_cpu=args.device == "cpu",
            gradient_checkpointing=args.gradient_checkpointing,
            bf16=False,
            fp16=False,
            model_init_kwargs={"dtype": args.dtype},
            report_to="none",
            logging_strategy="no",
            save_strategy="no",
            eval_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=args.seed,
        )
        timer = StepTimer(windows, args.warmup)
        trainer = TimedGRPOTrainer(
            model=args.model_dir,
            reward_funcs=toy_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )
        n_params = sum(p.numel() for p in trainer.model.parameters())
        load_s = time.perf_counter() - t_start
        t0 = time.perf_counter()
        trainer.train()
        total_s = time.perf_counter() - t0

    # Per-step splits of the timed steps: generation, rollout (generation + reference forward +
    # reward + advantages), the rest being the policy forward, backward and AdamW.
    for rec, log in zip(timer.steps, trainer.w1_log, strict=False):
        rec["generation_s"] = log["generation_s"]
        rec["rollout_s"] = log["rollout_s"]
        rec["training_s"] = rec["seconds"] - log["rollout_s"]

    problems = []
    for i, r in enumerate(trainer.w1_log):
        if r["completions"] != batch:
            problems.append(f"step {i}: {r['completions']} completions, want {batch}")
        if r["completion_lengths"] != [completion_len] or r["completion_width"] != completion_len:
            problems.append(f"step {i}: completion lengths {r['completion_lengths']}")
        if r["prompt_keys"] != want_keys:
            problems.append(f"step {i}: prompt ids differ from prompts.json")
        if r["unique_prompts"] != n_prompts or not r["groups_of_one_prompt"]:
            problems.append(f"step {i}: {r['unique_prompts']} prompts, want {n_prompts} x {n_gen}")
        if not r["ref_logps"] or r["ref_forward_calls"] < 1:
            problems.append(f"step {i}: no reference forward")
    if len(trainer.w1_log) != len(timer.steps):
        problems.append(f"{len(trainer.w1_log)} generation rounds for {len(timer.steps)} steps")

    summary = windows.summary(("generation_s", "rollout_s", "training_s"))
    result = {
        "system": "trl",
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "device": "cpu" if args.device == "cpu" else torch.cuda.get_device_name(0),
        "gradient_checkpointing": args.gradient_checkpointing,
        "device_peak_bytes": (
            torch.cuda.max_memory_allocated() if args.device == "cuda" else None
        ),
        "dtype": args.dtype,
        "grad_accum": args.grad_accum,
        "threads": torch.get_num_threads(),
        "params": n_params,
        "load_s": load_s,
        "first_step_s": timer.steps[0]["seconds"] if timer.steps else None,
        "total_train_s": total_s,
        "peak_rss_bytes": cleanwin.peak_rss_bytes(),
        "generated_tokens": batch * completion_len,
        **summary,
        "check": {
            "completions_per_step": sorted({r["completions"] for r in trainer.w1_log}),
            "completion_lengths": sorted(
                {x for r in trainer.w1_log for x in r["completion_lengths"]}
            ),
            "prompt_lengths": sorted({x for r in trainer.w1_log for x in r["prompt_lengths"]}),
            "ref_forward_calls_per_step": sorted({r["ref_forward_calls"] for r in trainer.w1_log}),
            "old_policy_forward": any(r["old_logps"] for r in trainer.w1_log),
            "problems": problems,
        },
    }
    for r in trainer.w1_log:
        r.pop("prompt_keys", None)
    cleanwin.emit("RESULT", result)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
