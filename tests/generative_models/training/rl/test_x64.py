"""The whole loop under ``jax_enable_x64``: Python ints and NumPy arrays then trace as 64-bit.

A user who enables 64-bit types for other work in the same process must still be able to train:
the sampler's cache index and the loop's NumPy data used to mix int64 and int32 indices
(``dynamic_update_slice``), which failed at the first rollout. The run goes in a child process,
since the flag is global to JAX.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_enable_x64", True)
    import numpy as np, optax
    from flax import nnx
    from artifex.demos.addition import addition_dataset, demo_tokenizer
    from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
    from artifex.generative_models.training import GRPOConfig, GRPOTrainer
    from artifex.generative_models.training.rl.loop import TrainConfig, train
    from artifex.generative_models.training.rl.rewards import math_answer_reward
    from artifex.generative_models.training.rl.rollout import RolloutConfig

    out = sys.argv[1]
    rows, eval_rows = addition_dataset(seed=0, num_eval=8)
    tok = demo_tokenizer()

    # one layer of width 16: the int64/int32 mixing this guards against is in the sampler's and
    # the loop's indices, whatever the model's size
    config = CausalLMConfig.tiny(
        vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32, num_layers=1,
        num_heads=1, num_kv_heads=1, head_dim=16, max_position_embeddings=32,
        bos_token_id=tok.bos_id, eos_token_id=tok.eos_ids, pad_token_id=tok.pad_id,
    )

    def run(num_steps):
        model = CausalLM(config, rngs=nnx.Rngs(0))
        ref = CausalLM(config, rngs=nnx.Rngs(100))
        opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        trainer = GRPOTrainer(model, opt, GRPOConfig(num_generations=4, beta=0.05),
                              reference_model=ref)
        loop = TrainConfig(num_steps=num_steps, prompts_per_step=2, seed=1, progress=False,
                           eval_every=1, checkpoint_dir=out + "/ckpt", checkpoint_every=1)
        result = train(trainer, tok, rows[:32], [math_answer_reward()], loop,
                       RolloutConfig(max_new_tokens=4), eval_dataset=eval_rows)
        return trainer, result

    trainer, first = run(1)
    trainer, resumed = run(2)  # resumes from step 1's checkpoint
    params = jax.tree.leaves(nnx.state(trainer.model, nnx.Param))
    print("RESULT " + json.dumps({
        "steps": len(first.history), "resumed_from": resumed.start_step,
        "resumed_steps": len(resumed.history),
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "finite": bool(all(np.isfinite(np.asarray(p)).all() for p in params)),
        "metrics_finite": bool(all(np.isfinite(v) for m in first.history + resumed.history
                                   for v in m.values() if isinstance(v, float))),
    }))
    """
)


@pytest.mark.slow
def test_training_runs_and_resumes_with_x64_enabled(tmp_path):
    # the tests' XLA flags (their compile settings) without the 8 host devices: one device
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if "xla_force_host_platform_device_count" not in f]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["steps"] == 1 and result["resumed_from"] == 1, result
    assert result["resumed_steps"] == 1, result
    # the model keeps its own dtype: x64 changes how Python numbers trace, not the weights
    assert result["param_dtypes"] == ["float32"], result
    assert result["finite"] and result["metrics_finite"], result
