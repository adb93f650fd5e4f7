"""W1 with Hugging Face TRL's GRPOTrainer on the CPU: seconds per whole step.

Run in the TRL venv (see ``benchmarks/peers/README.md``), not in the project's Python:

    /tmp/artifex-peers/trl/bin/python benchmarks/peers/trl_w1.py [--steps 8] [--warmup 2]

Builds everything locally (no hub access): a random-init ``Qwen2ForCausalLM`` of W1's shapes
(vocabulary 4096, width 256, 4 layers, 4 query / 2 key-value heads of width 64, MLP 768, tied
embeddings, q/k/v biases, RoPE base 1e6, fp32), a WordLevel tokenizer over 4096 tokens, and a
dataset of prompts of exactly 32 tokens. One TRL step is 8 prompts x 4 generations = 32
completions of exactly 96 tokens (``min_new_tokens=96``: the EOS logit is masked until then),
``beta=0.04`` (reference model forward), one AdamW update, no vLLM, no old-policy forward
(``num_iterations=1``, ``steps_per_generation=1``: on-policy, as ours).

Prints a human-readable summary and, last, one line ``PEER_RESULT {json}`` that
``benchmarks/run.py --only peers`` parses. The run fails (exit 1) when a step did not do W1's
work: a completion that is not 96 tokens, a batch that is not 8 x 4, no reference forward.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch
import transformers
import trl
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    TrainerCallback,
)
from trl import GRPOConfig, GRPOTrainer

VOCAB = 4096
NUM_PROMPTS = 8
NUM_GENERATIONS = 4
PROMPT_LEN = 32
COMPLETION_LEN = 96
BETA = 0.04
PAD, EOS = 0, 1  # "<pad>", "<eos>"; the other 4094 ids are "t2".."t4095"


def build_model_dir(path: str, seed: int) -> None:
    """Saves a random-init W1 Qwen2 model and its tokenizer under ``path``."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        hidden_act="silu",
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=EOS,
        pad_token_id=PAD,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    model.generation_config.bos_token_id = None
    model.save_pretrained(path)

    vocab = {"<pad>": PAD, "<eos>": EOS}
    vocab.update({f"t{i}": i for i in range(2, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>"
    )
    fast.padding_side = "left"
    fast.save_pretrained(path)


def build_dataset(n: int, seed: int) -> Dataset:
    """``n`` prompts of exactly ``PROMPT_LEN`` random tokens (no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, PROMPT_LEN), generator=g)
    return Dataset.from_dict({"prompt": [" ".join(f"t{i}" for i in row.tolist()) for row in ids]})


def toy_reward(completions, completion_ids, **kwargs):
    """The fraction of even token ids in each completion (W1's toy reward)."""
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
        groups = [keys[i : i + NUM_GENERATIONS] for i in range(0, len(keys), NUM_GENERATIONS)]
        self.w1_log.append(
            {
                "generation_s": self._gen_s,
                "rollout_s": rollout_s,  # generation + reference forward + reward + advantages
                "completions": int(out["completion_ids"].shape[0]),
                "completion_lengths": sorted(set(out["completion_mask"].sum(1).tolist())),
                "completion_width": int(out["completion_ids"].shape[1]),
                "prompt_lengths": sorted(set(self._prompt_lens)),
                "unique_prompts": len(set(keys)),
                "groups_of_one_prompt": all(len(set(g)) == 1 for g in groups),
                "ref_logps": out.get("ref_per_token_logps") is not None,
                "ref_forward_calls": self._ref_calls,
                "old_logps": out.get("old_per_token_logps") is not None,
            }
        )
        return out


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (on_step_begin -> on_step_end) and between step ends."""

    def __init__(self):
        self.begin: list[float] = []
        self.end: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        self.end.append(time.perf_counter())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="trl_w1_") as tmp:
        model_dir = os.path.join(tmp, "model")
        build_model_dir(model_dir, args.seed)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
        dataset = build_dataset(NUM_PROMPTS * args.steps, args.seed + 1)
        assert all(len(tokenizer(p)["input_ids"]) == PROMPT_LEN for p in dataset["prompt"])

        batch = NUM_PROMPTS * NUM_GENERATIONS
        config = GRPOConfig(
            output_dir=os.path.join(tmp, "out"),
            per_device_train_batch_size=batch,  # completions per step (32)
            generation_batch_size=batch,  # one generation batch per optimizer step
            gradient_accumulation_steps=1,
            num_generations=NUM_GENERATIONS,
            max_completion_length=COMPLETION_LEN,
            generation_kwargs={"min_new_tokens": COMPLETION_LEN},  # no early stop
            temperature=1.0,
            beta=BETA,
            num_iterations=1,
            loss_type="grpo",  # per-sequence token mean, as W1's GRPOConfig defaults
            learning_rate=1e-5,
            optim="adamw_torch",
            max_steps=args.steps,
            use_vllm=False,
            use_cpu=True,
            bf16=False,
            fp16=False,
            model_init_kwargs={"dtype": "float32"},
            report_to="none",
            logging_strategy="no",
            save_strategy="no",
            eval_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=args.seed,
        )
        timer = StepTimer()
        trainer = TimedGRPOTrainer(
            model=model_dir,
            reward_funcs=toy_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )
        n_params = sum(p.numel() for p in trainer.model.parameters())
        t0 = time.perf_counter()
        trainer.train()
        total_s = time.perf_counter() - t0

    w = args.warmup
    step_s = [e - b for b, e in zip(timer.begin, timer.end, strict=True)][w:]
    log = trainer.w1_log[w:]
    gen_s = [r["generation_s"] for r in log]
    rollout_s = [r["rollout_s"] for r in log]
    train_s = [s - r for s, r in zip(step_s, rollout_s, strict=True)]
    med = statistics.median

    problems = []
    for i, r in enumerate(trainer.w1_log):
        if r["completions"] != batch:
            problems.append(f"step {i}: {r['completions']} completions, want {batch}")
        if r["completion_lengths"] != [COMPLETION_LEN] or r["completion_width"] != COMPLETION_LEN:
            problems.append(f"step {i}: completion lengths {r['completion_lengths']}")
        if r["prompt_lengths"] != [PROMPT_LEN]:
            problems.append(f"step {i}: prompt lengths {r['prompt_lengths']}")
        if r["unique_prompts"] != NUM_PROMPTS or not r["groups_of_one_prompt"]:
            problems.append(f"step {i}: {r['unique_prompts']} prompts, want {NUM_PROMPTS} x 4")
        if not r["ref_logps"] or r["ref_forward_calls"] < 1:
            problems.append(f"step {i}: no reference forward")
    if len(trainer.w1_log) != args.steps:
        problems.append(f"{len(trainer.w1_log)} generation rounds for {args.steps} steps")

    result = {
        "peer": "trl",
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "threads": torch.get_num_threads(),
        "params": n_params,
        "steps_timed": len(step_s),
        "step_s": med(step_s),
        "step_s_all": [round(s, 4) for s in step_s],
        # step end to next step end: the loop's whole period, data loading and callbacks included
        "step_period_s": med([b - a for a, b in itertools.pairwise(timer.end)][w - 1 :]),
        "generation_s": med(gen_s),
        "rollout_s": med(rollout_s),
        "training_s": med(train_s),
        "total_train_s": total_s,
        "check": {
            "completions_per_step": sorted({r["completions"] for r in trainer.w1_log}),
            "completion_lengths": sorted(
                {x for r in trainer.w1_log for x in r["completion_lengths"]}
            ),
            "prompt_lengths": sorted({x for r in trainer.w1_log for x in r["prompt_lengths"]}),
            "unique_prompts_per_step": sorted({r["unique_prompts"] for r in trainer.w1_log}),
            "ref_forward_calls_per_step": sorted({r["ref_forward_calls"] for r in trainer.w1_log}),
            "old_policy_forward": any(r["old_logps"] for r in trainer.w1_log),
            "problems": problems,
        },
    }
    gen_ms, rollout_ms, train_ms = (1e3 * med(x) for x in (gen_s, rollout_s, train_s))
    print(
        f"TRL {trl.__version__} (transformers {transformers.__version__}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads), "
        f"{n_params / 1e6:.2f}M params\n"
        f"W1 step: median {med(step_s) * 1e3:.0f} ms over {len(step_s)} steps "
        f"(generation {gen_ms:.0f} ms, reference fwd + reward {rollout_ms - gen_ms:.0f} ms, "
        f"policy fwd+bwd + AdamW {train_ms:.0f} ms)\n"
        f"checks: {json.dumps(result['check'])}",
        flush=True,
    )
    print("PEER_RESULT " + json.dumps(result), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
