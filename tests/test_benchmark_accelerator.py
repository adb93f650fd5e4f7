"""The accounting of benchmarks/accelerator.py: parameter counts and rooflines.

The script itself is a benchmark (it runs in benchmarks/, not as a timed test); what it computes
from a workload is checked here against a real model's parameter count and a hand count.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from benchmarks import accelerator, hfdir


def _count(model: nnx.Module) -> dict[str, int]:
    out = {"matmul": 0, "other": 0}
    for x in jax.tree.leaves(nnx.state(model, nnx.Param)):
        kind = "matmul" if np.ndim(x) == 2 else "other"  # norms and biases are vectors
        out[kind] += int(np.size(x))
    return out


def test_the_parameter_counts_match_a_real_model_of_every_workload_shape():
    for name in ("w1", "w2", "q05", "long"):
        small = accelerator.small(hfdir.WORKLOADS[name], name)["model"]
        config = CausalLMConfig(**small, param_dtype="float32")
        counted = _count(CausalLM(config, rngs=nnx.Rngs(0)))
        # tied: the embedding is the output projection, counted once, as a matmul
        assert accelerator.all_params(small) == counted["matmul"], name
        assert accelerator.matmul_params(small) == counted["matmul"], name


def test_the_rooflines_by_hand():
    w = {
        "num_prompts": 2,
        "num_generations": 4,
        "prompt_length": 10,
        "completion_length": 20,
        "beta": 0.04,
        "model": {
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_layers": 3,
            "num_heads": 2,
            "num_kv_heads": 1,
            "head_dim": 4,
            "vocab_size": 32,
            "tie_word_embeddings": False,
        },
    }
    per_layer = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16  # q, k+v, o, gate+up+down
    n = 3 * per_layer + 8 * 32
    probe = {"copy_bytes_per_s": 1e9, "matmul_flops_per_s": {"bfloat16": 1e12}}
    roof = accelerator.rooflines(w, {"dtype": "bfloat16", "remat": True}, probe)
    tokens = 8 * 30
    assert roof["update_flops"] == (6 + 2 + 2) * n * tokens
    cache_per_token = 2 * 3 * 1 * 4 * 2  # k and v, layers, kv heads, head dim, bf16 bytes
    weights = (n + 8 * 32) * 2  # the untied embedding is read too
    expected = (weights + 8 * (10 + 10) * cache_per_token) / 1e9
    np.testing.assert_allclose(roof["decode_step_s"], expected)


def test_the_family_workloads_are_the_shapes_the_docs_describe():
    # docs/benchmarks.md ("More model families") quotes these parameter counts; the configs
    # must build as they are and keep their family's features.
    g3 = CausalLMConfig(**hfdir.WORKLOADS["g3"]["model"], param_dtype="bfloat16")
    assert g3.num_params() == 999_885_952
    assert g3.sliding_layers.count(False) == 4  # five sliding-window layers to one global
    assert g3.to_hf_config()["model_type"] == "gemma3_text"
    moe = CausalLMConfig(**hfdir.WORKLOADS["moe"]["model"], param_dtype="float32")
    assert moe.num_params() == 15_485_696
    assert (moe.num_experts, moe.num_experts_per_tok) == (16, 4)
    assert hfdir.WORKLOADS["g3"]["dtype"] == "bfloat16" and "dtype" not in hfdir.WORKLOADS["moe"]


def test_the_ragged_row_runs_the_ragged_benchmark_at_the_scale_asked(monkeypatch, tmp_path):
    # accelerator.py --ragged: benchmarks/ragged.py, ours only, W2's shape on an accelerator and
    # the CPU-sized flags with --scale cpu; its records come back, a failure is a row's error.
    import json
    import subprocess

    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        with open(cmd[cmd.index("--json") + 1], "w") as fh:
            json.dump({"results": {"rollout/new": []}}, fh)
        return subprocess.CompletedProcess(cmd, 0, stdout="| Run |\nnot a table line\n")

    monkeypatch.setattr(accelerator.subprocess, "run", fake_run)
    for scale, shape in (("gpu", ["--w2"]), ("cpu", accelerator.RAGGED_CPU_FLAGS)):
        record = accelerator.ragged_row(scale, str(tmp_path), {}, 100.0)
        assert record["results"] == {"rollout/new": []}
        cmd = seen[-1]
        assert cmd[1] == "benchmarks/ragged.py" and cmd[2 : 2 + len(shape)] == shape
        assert "--no-peer" in cmd and record["command"].endswith(str(tmp_path / "ragged.json"))
    assert accelerator.ragged_row("gpu", str(tmp_path), {}, 5.0) == {
        "error": "no time left in --budget-s"
    }
