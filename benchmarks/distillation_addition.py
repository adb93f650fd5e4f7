"""On-policy distillation on the addition demo: a smaller student, GRPO alone against distillation.

1. Teacher: the demo's model (``artifex.demos.addition.demo_model``), warmed up and trained
   with GRPO with the settings of ``artifex-grpo demo`` (``DemoConfig``'s), for
   ``--teacher-steps`` steps, then saved (``OUT/teacher``; a later run with the same seed and
   teacher settings reuses it).
2. Student: a smaller model (``--student-width``, ``--student-layers``), warmed up by the demo's
   supervised warm-up to ``--student-warmup-target`` validation accuracy.
3. Arms, each from the same warmed-up student with the same rollout budget per step (the
   demo's prompts and generations) and optimizer (AdamW at ``--learning-rate``): ``grpo`` (the
   demo's GRPO settings), ``distill`` (on-policy distillation alone: ``distillation_coeff=1``,
   ``policy_loss_coeff=0``, ``beta=0``, ``--divergence``) and ``grpo+distill`` (both terms).
   Held-out pass@1 (greedy, the demo's 200 held-out problems) every ``--eval-every`` steps.

Writes ``OUT/record.json`` (every curve, the teacher's pass@1, the first evaluated step at
which each arm reaches it and 90% of it, seconds per step, the command and the CPU) and
``OUT/curves.png``. The defaults are the run in docs/algorithm.md (about 25 minutes on 2 shared
cores):

    python benchmarks/distillation_addition.py --out runs/distill --teacher-steps 400 \\
        --steps 800 --eval-every 40 --learning-rate 1e-3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from artifex.demos.addition import (
    DemoConfig,
    addition_dataset,
    demo_model,
    demo_tokenizer,
    digit_reward,
    supervised_warmup,
)
from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from artifex.generative_models.training.rl import (
    GRPOConfig,
    GRPOTrainer,
    Policy,
    RewardCombiner,
    RolloutConfig,
    TrainConfig,
    evaluate,
    math_answer_reward,
    train,
)

DEMO = DemoConfig()
ROLLOUT = RolloutConfig(max_new_tokens=4)


def _optimizer(model: CausalLM, learning_rate: float) -> nnx.Optimizer:
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, learning_rate, 10), optax.constant_schedule(learning_rate)],
        [10],
    )
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.0)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def _grpo_config(**changes) -> GRPOConfig:
    """The demo's GRPO settings."""
    base = dict(
        num_generations=DEMO.num_generations,
        beta=DEMO.beta,
        entropy_coeff=0.0,
        loss_aggregation="token_mean",
        clip_param=0.2,
        clip_param_high=0.28,
    )
    base.update(changes)
    return GRPOConfig(**base)


def _warm_up(model, tokenizer, train_rows, target: float, seed: int, max_steps: int) -> int:
    reward = math_answer_reward(last_number_fallback=True)
    holder = Policy(model, GRPOConfig())
    val_rows = train_rows[-200:]

    def accurate_enough() -> bool:
        return evaluate(holder, tokenizer, val_rows, reward, ROLLOUT)["eval/pass@1"] >= target

    losses = supervised_warmup(
        model,
        tokenizer,
        train_rows[: DEMO.warmup_examples],
        max_steps=max_steps,
        seed=seed,
        stop=accurate_enough,
    )
    return len(losses)


def _run(trainer, tokenizer, train_rows, eval_rows, steps, eval_every, seed, log_dir):
    reward = math_answer_reward(last_number_fallback=True)
    rewards = RewardCombiner([reward, digit_reward], weights=[1.0, DEMO.partial_credit])
    t0 = time.perf_counter()
    result = train(
        trainer,
        tokenizer,
        train_rows,
        rewards,
        TrainConfig(
            num_steps=steps,
            prompts_per_step=DEMO.prompts_per_step,
            seed=seed,
            eval_every=eval_every,
            log_dir=log_dir,
            checkpoint_dir=None,
            overwrite=True,
            progress=False,
        ),
        ROLLOUT,
        eval_dataset=eval_rows,
        eval_reward=reward,
    )
    seconds = time.perf_counter() - t0
    curve = [(int(step), float(ev["eval/pass@1"])) for step, ev in result.evaluations]
    return curve, seconds, result.history


def _student(tokenizer, width: int, layers: int, seed: int) -> CausalLM:
    config = CausalLMConfig.tiny(
        vocab_size=tokenizer.vocab_size,
        hidden_size=width,
        intermediate_size=3 * width,
        num_layers=layers,
        num_heads=max(width // 16, 1),
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=32,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_ids,
        pad_token_id=tokenizer.pad_id,
    )
    return CausalLM(config, rngs=nnx.Rngs(seed))


def _first_at(curve: list[tuple[int, float]], level: float) -> int | None:
    return next((step for step, value in curve if value >= level), None)


ARMS = ("grpo", "distill", "grpo+distill")


def _machine() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/distillation_addition")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--teacher-steps", type=int, default=400)
    parser.add_argument("--student-width", type=int, default=32)
    parser.add_argument("--student-layers", type=int, default=2)
    parser.add_argument("--student-warmup-target", type=float, default=0.2)
    parser.add_argument("--warmup-max-steps", type=int, default=DEMO.warmup_max_steps)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--eval-every", type=int, default=40)
    parser.add_argument("--divergence", default="reverse_kl")
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=1e-3,
        help="the student arms' learning rate (the teacher keeps the demo's, 3e-4)",
    )
    parser.add_argument(
        "--teacher-learning-rate",
        type=float,
        default=None,
        help="the teacher's GRPO learning rate (default: the demo's, 3e-4)",
    )
    parser.add_argument(
        "--teacher-warmup-target",
        type=float,
        default=None,
        help="the held-out accuracy at which the teacher's supervised warm-up stops (default: "
        "the demo's, 0.35; --warmup-max-steps bounds it)",
    )
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    tokenizer = demo_tokenizer()
    train_rows, eval_rows = addition_dataset(args.seed, DEMO.num_eval)
    reward = math_answer_reward(last_number_fallback=True)
    record: dict = {
        "command": "python benchmarks/distillation_addition.py " + " ".join(argv or sys.argv[1:]),
        "args": vars(args),
        "machine": f"{_machine()}, {os.cpu_count()} cores",
        "arms": {},
    }

    # 1. The teacher: the demo's model and training (reused from OUT/teacher when it was made
    # with the same settings).
    teacher_dir = os.path.join(args.out, "teacher")
    made_with = {
        "seed": args.seed,
        "teacher_steps": args.teacher_steps,
        "warmup_max_steps": args.warmup_max_steps,
        **({} if args.teacher_learning_rate is None else {"lr": args.teacher_learning_rate}),
        **({} if args.teacher_warmup_target is None else {"warm": args.teacher_warmup_target}),
    }
    cached = None
    if os.path.isfile(os.path.join(teacher_dir, "teacher.json")):
        with open(os.path.join(teacher_dir, "teacher.json")) as fh:
            cached = json.load(fh)
    if cached is not None and cached.get("made_with") == made_with:
        teacher = CausalLM.from_pretrained(teacher_dir)
        record["teacher"] = cached
    else:
        teacher = demo_model(tokenizer, args.seed)
        t0 = time.perf_counter()
        warm = _warm_up(
            teacher,
            tokenizer,
            train_rows,
            args.teacher_warmup_target or DEMO.warmup_target,
            args.seed,
            args.warmup_max_steps,
        )
        trainer = GRPOTrainer(
            teacher,
            _optimizer(teacher, args.teacher_learning_rate or DEMO.learning_rate),
            _grpo_config(),
            reference_model=nnx.clone(teacher),
        )
        curve, seconds, _ = _run(
            trainer, tokenizer, train_rows, eval_rows, args.teacher_steps,
            max(args.teacher_steps // 5, 1), args.seed, os.path.join(args.out, "logs_teacher"),
        )  # fmt: skip
        teacher.save_pretrained(teacher_dir)
        record["teacher"] = {
            "warmup_steps": warm,
            "grpo_steps": args.teacher_steps,
            "curve": curve,
            "pass@1": curve[-1][1],
            "seconds": round(time.perf_counter() - t0, 1),
            "parameters": _parameters(teacher),
            "made_with": made_with,
        }
        with open(os.path.join(teacher_dir, "teacher.json"), "w") as fh:
            json.dump(record["teacher"], fh)
    holder = Policy(teacher, GRPOConfig())
    teacher_pass = evaluate(holder, tokenizer, eval_rows, reward, ROLLOUT)["eval/pass@1"]
    record["teacher"]["pass@1"] = teacher_pass
    print(f"teacher: held-out pass@1 {teacher_pass:.3f}", flush=True)

    # 2. The student, warmed up once; every arm starts from these weights.
    student = _student(tokenizer, args.student_width, args.student_layers, args.seed + 1)
    warm = _warm_up(
        student,
        tokenizer,
        train_rows,
        args.student_warmup_target,
        args.seed,
        args.warmup_max_steps,
    )
    record["student"] = {
        "warmup_steps": warm,
        "parameters": _parameters(student),
        "pass@1": evaluate(Policy(student, GRPOConfig()), tokenizer, eval_rows, reward, ROLLOUT)[
            "eval/pass@1"
        ],
        "width": args.student_width,
        "layers": args.student_layers,
    }

    # 3. The arms.
    for arm in args.arms:
        # Every arm starts from the warmed-up weights, in buffers of its own (the update
        # donates them).
        model = nnx.clone(student)
        nnx.update(model, jax.tree.map(jnp.copy, nnx.state(student)))
        distill = {
            "distillation_coeff": 1.0,
            "distillation_divergence": args.divergence,
        }
        if arm == "grpo":
            config, kwargs = _grpo_config(), {"reference_model": nnx.clone(model)}
        elif arm == "distill":
            config = _grpo_config(beta=0.0, policy_loss_coeff=0.0, **distill)
            kwargs = {"teacher_model": teacher}
        else:  # "grpo+distill"
            config = _grpo_config(**distill)
            kwargs = {"reference_model": nnx.clone(model), "teacher_model": teacher}
        trainer = GRPOTrainer(model, _optimizer(model, args.learning_rate), config, **kwargs)
        curve, seconds, history = _run(
            trainer, tokenizer, train_rows, eval_rows, args.steps, args.eval_every, args.seed,
            os.path.join(args.out, f"logs_{arm.replace('+', '_')}"),
        )  # fmt: skip
        record["arms"][arm] = {
            "curve": curve,
            "seconds": round(seconds, 1),
            "seconds_per_step": round(seconds / args.steps, 3),
            "steps_to_teacher": _first_at(curve, teacher_pass),
            "steps_to_90pct_teacher": _first_at(curve, 0.9 * teacher_pass),
            "final_pass@1": curve[-1][1],
            "train_reward_last_10": float(
                np.mean([m["rewards/math_answer_reward"] for m in history[-10:]])
            ),
        }
        print(arm, json.dumps(record["arms"][arm]), flush=True)
        with open(os.path.join(args.out, "record.json"), "w") as fh:
            json.dump(record, fh, indent=1)
    _plot(record, os.path.join(args.out, "curves.png"))
    return record


def _parameters(model: CausalLM) -> int:
    return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def _plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for arm, data in record["arms"].items():
        steps, values = zip(*data["curve"], strict=True)
        ax.plot(steps, values, marker="o", markersize=3, label=f"student: {arm}")
    ax.axhline(record["teacher"]["pass@1"], color="black", linestyle="--", label="teacher")
    ax.set_xlabel(
        f"training step ({DEMO.prompts_per_step} prompts x {DEMO.num_generations} completions)"
    )
    ax.set_ylabel("held-out pass@1 (greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="lower right", fontsize=8)
    args = record["args"]
    ax.set_title(
        "2-digit addition: a smaller student, GRPO vs on-policy distillation\n"
        f"(student learning rate {args['learning_rate']:g}, {args['divergence']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
