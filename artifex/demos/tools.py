"""The tool-use demo: a tiny model learns with GRPO to call a multiply tool and answer.

The task: ``"4821*37"`` -> ``"178377"``, products of a 3-4 digit and a 2-digit number, far
beyond what a 0.2M-parameter character model can multiply. A ``multiply(a, b)`` tool is offered
through the chat template's ``tools`` argument; a correct episode is

    <|user|>4821*37<|assistant|><tool_call>{"name":"multiply","arguments":{"a":4821,"b":37}}
    </tool_call><eos><tool_response>178377</tool_response><|assistant|>178377<eos>

where the model writes the tool call and the final answer (completion mask 1) and the tool
response and the scaffolding around it are appended (mask 0). A short supervised warm-up on a few
formatted examples, half of them tool calls and half direct (necessarily wrong-ish) answers,
leaves a model that calls the tool on part of the problems; GRPO with the exact-answer reward
then teaches it to call the tool and copy the result. The demo reports held-out accuracy and the
tool-call rate before and after.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import AddedToken

from artifex.demos.addition import demo_model
from artifex.generative_models.models.causal_lm import CausalLM, Tokenizer
from artifex.generative_models.training.rl.core.configs import GRPOConfig
from artifex.generative_models.training.rl.rewards import math_answer_reward
from artifex.generative_models.training.rl.rollouts.multiturn import (
    MultiTurnConfig,
    MultiTurnRollout,
    ToolEnvironment,
    run_episodes,
)
from artifex.generative_models.training.rl.rollouts.multiturn.chat_segments import appended_text
from artifex.generative_models.training.rl.rollouts.multiturn.tools import tool_schema
from artifex.generative_models.training.rl.rollouts.rollout import Policy, RolloutConfig
from artifex.generative_models.training.rl.run.loop import TrainConfig, train
from artifex.generative_models.training.rl.update.trainer import GRPOTrainer
from artifex.generative_models.utils.atomic import atomic_write_json

__all__ = [
    "TOOL_CHAT_TEMPLATE",
    "ToolDemoConfig",
    "multiplication_dataset",
    "multiply",
    "run_tool_demo",
    "tool_demo_tokenizer",
    "tool_warmup",
    "tool_warmup_rows",
]

TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}("
    "{{ t.function.parameters.properties | list | join(',') }}){% endfor %}</tools>{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<tool_response>{{ m.content }}"
    "</tool_response>{% else %}<|{{ m.role }}|>{{ m.content }}"
    "{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_ADDED = (
    "<tools>",
    "</tools>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)


def multiply(a: int, b: int) -> int:
    """Multiplies two integers exactly.

    Args:
        a: The first factor.
        b: The second factor.

    Returns:
        The product.

    Examples:
        >>> from artifex.demos.tools import multiply
        >>> multiply(1234, 56)
        69104
    """
    return int(a) * int(b)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolDemoConfig:
    """Settings of the tool demo (the defaults are those of ``artifex-grpo demo --task tools``).

    Attributes:
        seed: Seeds everything.
        num_eval: Held-out problems.
        warmup_examples: Formatted examples for the supervised warm-up.
        tool_fraction: Fraction of warm-up examples that call the tool (the rest answer
            directly).
        warmup_max_steps: Most supervised steps.
        warmup_target: The warm-up stops once greedy accuracy on ``warmup_validation``
            training problems (not the held-out ones) reaches this, checked every
            ``warmup_check_every`` steps: where the warm-up ends depends on the machine's
            rounding, so it ends on a measured accuracy, not a step count.
        warmup_validation: Validation problems for ``warmup_target``.
        warmup_check_every: Supervised steps between two validations.
        grpo_steps: GRPO steps.
        prompts_per_step: Prompts per step.
        num_generations: Episodes per prompt.
        learning_rate: GRPO learning rate.
        out_dir: Where metrics and the summary go (``None``: a temporary directory).

    Examples:
        >>> from artifex.demos.tools import ToolDemoConfig
        >>> config = ToolDemoConfig(grpo_steps=10)
        >>> config.grpo_steps, config.tool_fraction
        (10, 0.5)
    """

    seed: int = 0
    num_eval: int = 100
    warmup_examples: int = 1024
    tool_fraction: float = 0.5
    warmup_max_steps: int = 3000
    warmup_target: float = 0.6
    warmup_validation: int = 50
    warmup_check_every: int = 100
    grpo_steps: int = 40
    prompts_per_step: int = 8
    num_generations: int = 8
    learning_rate: float = 5e-4
    out_dir: str | None = None


def tool_demo_tokenizer() -> Tokenizer:
    """Character tokenizer with the demo's chat template and tool tags as single tokens.

    Returns:
        The tokenizer.

    Examples:
        >>> from artifex.demos.tools import tool_demo_tokenizer
        >>> tok = tool_demo_tokenizer()
        >>> ids = tok.encode("<tool_call>", add_special_tokens=False)
        >>> len(ids), tok.chat_template is not None  # the tool tag is a single token
        (1, True)
    """
    tok = Tokenizer.for_characters(
        '0123456789*{}":,abcdefghijklmnopqrstuvwxyz() ', chat_template=TOOL_CHAT_TEMPLATE
    )
    tok.backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in _ADDED])
    return tok


def multiplication_dataset(
    seed: int = 0, num_eval: int = 100, size: int = 3000
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Random products ``a*b`` (1000 <= a < 10000, 10 <= b < 100), train and held-out rows.

    Args:
        seed: Seeds the problems.
        num_eval: Held-out rows.
        size: Training rows.

    Returns:
        ``(train_rows, eval_rows)``; each row has ``prompt`` (``"a*b"``), ``answer``, ``a``,
        ``b``.

    Examples:
        >>> from artifex.demos.tools import multiplication_dataset
        >>> train_rows, eval_rows = multiplication_dataset(seed=0, num_eval=5, size=20)
        >>> len(train_rows), len(eval_rows), sorted(train_rows[0])
        (20, 5, ['a', 'answer', 'b', 'prompt'])
        >>> row = train_rows[0]
        >>> int(row["answer"]) == row["a"] * row["b"]
        True
    """
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(size + num_eval):
        a, b = int(rng.integers(1000, 10000)), int(rng.integers(10, 100))
        rows.append({"prompt": f"{a}*{b}", "answer": str(a * b), "a": a, "b": b})
    return rows[num_eval:], rows[:num_eval]


def tool_warmup_rows(
    tokenizer: Tokenizer, rows: list[dict[str, Any]], tool_fraction: float, seed: int
) -> list[list[tuple[str, bool]]]:
    """Formatted warm-up examples: each a list of ``(text, written_by_the_model)`` pieces.

    A tool example is prompt, tool call, appended tool response and scaffolding, final answer;
    a direct example is prompt and an answer (which the model cannot compute).

    Args:
        tokenizer: The demo tokenizer.
        rows: Problems.
        tool_fraction: Fraction that call the tool.
        seed: Seeds which ones.

    Returns:
        One list of pieces per example.

    Examples:
        >>> from artifex.demos.tools import (
        ...     multiplication_dataset, tool_demo_tokenizer, tool_warmup_rows)
        >>> tok = tool_demo_tokenizer()
        >>> rows, _ = multiplication_dataset(num_eval=1, size=4)
        >>> examples = tool_warmup_rows(tok, rows, tool_fraction=1.0, seed=0)
        >>> len(examples), [written for _, written in examples[0]][:2]  # prompt, then the model
        (4, [False, True])
    """
    rng = np.random.default_rng(seed)
    schemas = [tool_schema(multiply)]
    eos = tokenizer.eos_token or ""
    out = []
    for row in rows:
        user = [{"role": "user", "content": row["prompt"]}]
        prompt = tokenizer.apply_chat_template(
            user, add_generation_prompt=True, tokenize=False, tools=schemas
        )
        pieces = [(prompt, False)]
        if rng.random() < tool_fraction:
            call = (
                '<tool_call>{"name":"multiply","arguments":'
                f'{{"a":{row["a"]},"b":{row["b"]}}}}}</tool_call>'
            )
            history = [*user, {"role": "assistant", "content": call}]
            obs = [{"role": "tool", "name": "multiply", "content": row["answer"]}]
            pieces += [
                (call, True),
                (appended_text(tokenizer, history, obs, schemas, call), False),
            ]
        pieces.append((row["answer"] + eos, True))
        out.append(pieces)
    return out


def tool_warmup(
    model: CausalLM,
    tokenizer: Tokenizer,
    examples: list[list[tuple[str, bool]]],
    *,
    steps: int,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    seed: int = 0,
    stop: Callable[[], bool] | None = None,
    check_every: int = 100,
) -> list[float]:
    """Teacher-forced training on the model-written pieces only (the loss mask of GRPO).

    Training stops after ``steps``, or earlier at the first check (every ``check_every``
    steps) where ``stop()`` returns True.

    Args:
        model: The model (updated in place).
        tokenizer: Its tokenizer.
        examples: From :func:`tool_warmup_rows`.
        steps: Most optimizer steps.
        batch_size: Examples per step.
        learning_rate: Adam learning rate.
        seed: Seeds the example sampling.
        stop: Optional early-stopping test, e.g. "validation accuracy >= 0.6".
        check_every: Steps between calls of ``stop``.

    Returns:
        The loss of each step.

    Examples:
        >>> from artifex.demos.addition import demo_model
        >>> from artifex.demos.tools import (
        ...     multiplication_dataset, tool_demo_tokenizer, tool_warmup, tool_warmup_rows)
        >>> tok = tool_demo_tokenizer()
        >>> rows, _ = multiplication_dataset(num_eval=1, size=8)
        >>> examples = tool_warmup_rows(tok, rows, tool_fraction=0.5, seed=0)
        >>> model = demo_model(tok, max_positions=128)
        >>> losses = tool_warmup(model, tok, examples, steps=2, batch_size=4)
        >>> len(losses)
        2
    """
    seqs, masks = [], []
    for pieces in examples:
        ids, mask = [], []
        for text, by_model in pieces:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            mask += [int(by_model)] * len(piece)
        seqs.append(ids)
        masks.append(mask)
    width = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), width), np.int32)
    loss_mask = np.zeros((len(seqs), width), np.float32)
    attn = np.zeros((len(seqs), width), np.int32)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        ids[i, : len(s)], loss_mask[i, : len(m)], attn[i, : len(s)] = s, m, 1
    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)

    @nnx.jit
    def step(model: CausalLM, optimizer: nnx.Optimizer, ids, attn, loss_mask):
        def loss_fn(m: CausalLM) -> jax.Array:
            logp = jax.nn.log_softmax(m(ids, attention_mask=attn)[:, :-1])
            tok = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
            w = loss_mask[:, 1:]
            return -jnp.sum(tok * w) / jnp.maximum(jnp.sum(w), 1.0)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(seed)
    losses = []
    for i in range(steps):
        idx = rng.integers(0, len(seqs), size=batch_size)
        losses.append(float(step(model, optimizer, ids[idx], attn[idx], loss_mask[idx])))
        if stop is not None and (i + 1) % check_every == 0 and stop():
            break
    return losses


def run_tool_demo(config: ToolDemoConfig | None = None, *, verbose: bool = True) -> dict[str, Any]:
    """Runs the tool demo and returns its summary.

    Args:
        config: Demo settings.
        verbose: Print progress and the summary.

    Returns:
        A JSON-able summary: held-out accuracy and tool-call rate before/after, times.

    Examples:
        Not run with the other docstring examples: the default settings train the whole demo,
        and settings small enough for a docstring learn nothing.

        >>> from artifex.demos.tools import ToolDemoConfig, run_tool_demo
        >>> summary = run_tool_demo(ToolDemoConfig(out_dir="runs/tools"))  # doctest: +SKIP
        >>> summary["tool_call_rate_after"] > summary["tool_call_rate_before"]  # doctest: +SKIP
        True
    """
    import tempfile

    cfg = ToolDemoConfig() if config is None else config
    out_dir = cfg.out_dir or tempfile.mkdtemp(prefix="artifex-grpo-tools-")
    os.makedirs(out_dir, exist_ok=True)
    say = print if verbose else (lambda *a, **k: None)
    t_start = time.perf_counter()
    train_rows, eval_rows = multiplication_dataset(cfg.seed, cfg.num_eval)
    tokenizer = tool_demo_tokenizer()
    model = demo_model(tokenizer, cfg.seed, max_positions=160)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    say(f"model: {n_params:,} parameters; tool: multiply(a, b); task: 4-digit a * 2-digit b")

    multi = MultiTurnConfig(max_turns=3, max_new_tokens=56, max_completion_tokens=112)
    rollout_fn = MultiTurnRollout(lambda: ToolEnvironment([multiply], timeout=5.0), multi)
    reward = math_answer_reward(last_number_fallback=True)
    rcfg = RolloutConfig(max_new_tokens=multi.max_new_tokens)

    holder = Policy(model, GRPOConfig())  # evaluation samples with the model as it is
    # Validation problems: the last training rows (the warm-up and GRPO use the first ones).
    val_rows = train_rows[-cfg.warmup_validation :] if cfg.warmup_validation else []
    warmup_checks: list[float] = []

    def accurate_enough() -> bool:
        acc = rollout_fn.evaluate(holder, tokenizer, val_rows, reward, rcfg)["eval/pass@1"]
        warmup_checks.append(acc)
        return acc >= cfg.warmup_target

    t0 = time.perf_counter()
    warm = tool_warmup_rows(
        tokenizer, train_rows[: cfg.warmup_examples], cfg.tool_fraction, cfg.seed
    )
    losses = tool_warmup(
        model,
        tokenizer,
        warm,
        steps=cfg.warmup_max_steps,
        seed=cfg.seed,
        stop=accurate_enough if val_rows else None,
        check_every=cfg.warmup_check_every,
    )
    t_warmup = time.perf_counter() - t0
    if val_rows and (not warmup_checks or warmup_checks[-1] < cfg.warmup_target):
        say(
            f"warning: the warm-up ended after {len(losses)} steps below its target "
            f"(validation accuracy {warmup_checks[-1] if warmup_checks else float('nan'):.2f} "
            f"< {cfg.warmup_target}); GRPO starts from a weaker model"
        )
    factory = rollout_fn.environment_factory

    def sampled(m: CausalLM) -> dict[str, float]:
        """Accuracy and tool-call rate of 4 sampled episodes (temperature 1) per problem."""
        ep = run_episodes(
            m, tokenizer, eval_rows, factory, multi, key=jax.random.key(1), num_generations=4
        )
        answers = [row["answer"] for row in eval_rows for _ in range(4)]
        right = [f.strip() == a for f, a in zip(ep.final_turns, answers, strict=True)]
        return {
            "accuracy": float(np.mean(right)),
            "tool_call_rate": float(np.mean(ep.tool_calls > 0)),
        }

    before = rollout_fn.evaluate(holder, tokenizer, eval_rows, reward, rcfg)
    before_sampled = sampled(model)
    say(
        f"after warm-up on {cfg.warmup_examples} examples ({len(losses)} steps, loss "
        f"{losses[0]:.2f} -> {losses[-1]:.2f}, {t_warmup:.0f} s): held-out greedy accuracy "
        f"{before['eval/pass@1']:.3f}, tool-call rate {before['eval/tool_call_rate']:.3f}; "
        f"sampled accuracy {before_sampled['accuracy']:.3f}, tool-call rate "
        f"{before_sampled['tool_call_rate']:.3f}"
    )

    optimizer = nnx.Optimizer(
        model, optax.adamw(cfg.learning_rate, weight_decay=0.0), wrt=nnx.Param
    )
    grpo = GRPOConfig(
        num_generations=cfg.num_generations,
        beta=0.0,
        loss_aggregation="token_mean",
        clip_param=0.2,
        clip_param_high=0.28,
    )
    trainer = GRPOTrainer(model, optimizer, grpo)
    t0 = time.perf_counter()
    result = train(
        trainer,
        tokenizer,
        train_rows[cfg.warmup_examples :],
        [reward],
        TrainConfig(
            num_steps=cfg.grpo_steps,
            prompts_per_step=cfg.prompts_per_step,
            seed=cfg.seed,
            log_dir=os.path.join(out_dir, "logs"),
            progress=verbose,
        ),
        rcfg,
        rollout_fn=rollout_fn,
        evaluate_fn=rollout_fn.evaluate,
    )
    t_grpo = time.perf_counter() - t0
    after = rollout_fn.evaluate(trainer, tokenizer, eval_rows, reward, rcfg)
    after_sampled = sampled(model)
    hist = result.history
    key = "rewards/math_answer_reward"
    summary = {
        "held_out_accuracy_before": before["eval/pass@1"],
        "held_out_accuracy_after": after["eval/pass@1"],
        "tool_call_rate_before": before["eval/tool_call_rate"],
        "tool_call_rate_after": after["eval/tool_call_rate"],
        "sampled_accuracy_before": before_sampled["accuracy"],
        "sampled_accuracy_after": after_sampled["accuracy"],
        "sampled_tool_call_rate_before": before_sampled["tool_call_rate"],
        "sampled_tool_call_rate_after": after_sampled["tool_call_rate"],
        "train_reward_first_5_steps": float(np.mean([m[key] for m in hist[:5]])),
        "train_reward_last_5_steps": float(np.mean([m[key] for m in hist[-5:]])),
        "train_tool_call_rate_first_5_steps": float(
            np.mean([m["multiturn/tool_call_rate"] for m in hist[:5]])
        ),
        "train_tool_call_rate_last_5_steps": float(
            np.mean([m["multiturn/tool_call_rate"] for m in hist[-5:]])
        ),
        "warmup_steps": len(losses),
        "warmup_validation_accuracy": warmup_checks,
        "warmup_seconds": round(t_warmup, 1),
        "grpo_seconds": round(t_grpo, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "metrics": os.path.join(out_dir, "logs", "metrics.jsonl"),
        "out_dir": out_dir,
    }
    atomic_write_json(os.path.join(out_dir, "summary.json"), summary, indent=2)
    say("")
    say(
        f"held-out greedy accuracy: {summary['held_out_accuracy_before']:.3f} (before GRPO) -> "
        f"{summary['held_out_accuracy_after']:.3f} (after)"
    )
    say(
        f"tool-call rate:    {summary['tool_call_rate_before']:.3f} -> "
        f"{summary['tool_call_rate_after']:.3f}"
    )
    say(
        f"sampled (T=1, 4 per problem): accuracy {before_sampled['accuracy']:.3f} -> "
        f"{after_sampled['accuracy']:.3f}, tool-call rate "
        f"{before_sampled['tool_call_rate']:.3f} -> {after_sampled['tool_call_rate']:.3f}"
    )
    say(
        f"time: warm-up {t_warmup:.0f} s, GRPO {t_grpo:.0f} s, "
        f"total {summary['total_seconds']:.0f} s"
    )
    return summary
