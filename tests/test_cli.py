"""The artifex-grpo command: train on a local HF directory and JSONL, errors, the demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from artifex.cli import load_rows, main
from artifex.demos.addition import (
    DemoConfig,
    addition_dataset,
    demo_model,
    demo_tokenizer,
    run_demo,
)
from artifex.generative_models.models.causal_lm import CausalLM, Tokenizer


@pytest.fixture()
def model_dir(tmp_path):
    tok = demo_tokenizer()
    model = demo_model(tok)
    path = tmp_path / "model"
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


@pytest.fixture()
def data_file(tmp_path):
    rows, _ = addition_dataset(num_eval=8)
    path = tmp_path / "train.jsonl"
    with open(path, "w") as fh:
        for row in rows[:32]:
            fh.write(json.dumps(row) + "\n")
    return str(path)


ARGS = [
    "--reward",
    "math",
    "--num-steps",
    "1",
    "--prompts-per-step",
    "4",
    "--num-generations",
    "4",
    "--max-new-tokens",
    "4",
    "--progress",
    "false",
    "--learning-rate",
    "1e-3",
]


@pytest.mark.parametrize("lora", [None, "all", "q_proj v_proj"])
def test_train_command_saves_a_loadable_model(
    tmp_path, model_dir, data_file, lora, capsys, monkeypatch
):
    # The command asks for the float32 precision notice once the model is loaded (before any
    # adapters) and prints it on stderr.
    import artifex.cli_train as cli_train  # the train command looks the notice up there

    seen = []

    def notice(model):
        seen.append(model)
        return "note: float32 parameters on a GPU (test)"

    monkeypatch.setattr(cli_train, "float32_precision_notice", notice)
    out = str(tmp_path / "out" / "model")
    extra = [] if lora is None else ["--lora-rank", "2"]
    if lora not in (None, "all"):
        extra += ["--lora-targets", *lora.split()]
    rc = main(
        [
            "train",
            "--model",
            model_dir,
            "--data",
            data_file,
            "--output",
            out,
            "--beta",
            "0.04",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            *ARGS,
            # the untrained model answers nothing right: a reward that differs within groups
            "--reward",
            "tests.spread_reward:text_reward",
            *extra,
        ]
    )
    assert rc == 0
    assert len(seen) == 1 and isinstance(seen[0], CausalLM)
    assert "note: float32 parameters on a GPU (test)" in capsys.readouterr().err
    trained = CausalLM.from_pretrained(out)
    base = CausalLM.from_pretrained(model_dir)
    ids = np.array([[1, 5, 6, 14, 7, 15]], np.int32)
    assert not np.allclose(np.asarray(trained(ids)), np.asarray(base(ids)))
    if lora == "q_proj v_proj":  # adapters (merged on export) on q and v only
        for layer, ref in zip(trained.layers, base.layers, strict=True):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                same = np.array_equal(getattr(layer.attn, name).kernel[...],
                                      getattr(ref.attn, name).kernel[...])  # fmt: skip
                assert same == (name not in ("q_proj", "v_proj")), name
            assert np.array_equal(layer.mlp.up_proj.kernel[...], ref.mlp.up_proj.kernel[...])
    assert os.path.exists(tmp_path / "out" / "logs" / "metrics.jsonl")
    assert os.listdir(tmp_path / "ckpt")


def test_missing_model_directory(tmp_path, data_file, capsys):
    rc = main(["train", "--model", str(tmp_path / "nope"), "--data", data_file, *ARGS])
    assert rc == 2
    assert "model directory not found" in capsys.readouterr().err


def test_dataset_without_prompt_column_leaves_no_checkpoint(tmp_path, model_dir, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    ckpt = tmp_path / "ckpt"
    rc = main(
        [
            "train",
            "--model",
            model_dir,
            "--data",
            str(bad),
            "--checkpoint-dir",
            str(ckpt),
            "--output",
            str(tmp_path / "o" / "m"),
            *ARGS,
        ]
    )
    assert rc == 2
    assert "no prompt column 'prompt'" in capsys.readouterr().err
    assert not ckpt.exists() or not os.listdir(ckpt)


def test_load_rows_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_rows(str(tmp_path / "missing.jsonl"))
    p = tmp_path / "x.jsonl"
    p.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="JSON object"):
        load_rows(str(p))
    txt = tmp_path / "x.txt"
    txt.write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown dataset format"):
        load_rows(str(txt))


def test_load_rows_reads_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "4+5=", "answer": "9"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    assert load_rows(str(tmp_path / "train.parquet")) == rows


def test_tokenizer_round_trip(tmp_path):
    tok = demo_tokenizer()
    tok.save_pretrained(str(tmp_path))
    again = Tokenizer.from_pretrained(str(tmp_path))
    assert again.encode("12+30=") == tok.encode("12+30=")
    assert (again.bos_id, again.eos_ids, again.pad_id) == (tok.bos_id, tok.eos_ids, tok.pad_id)


@pytest.mark.slow
def test_short_demo_raises_held_out_accuracy(tmp_path):
    # In a process of its own at the library's LLVM optimization level (the test suite compiles
    # at level 0, see conftest.py): this is the demo a user runs, and a training run's path
    # depends on float32 rounding, which the level changes.
    env = {k: v for k, v in os.environ.items() if k not in ("ARTIFEX_CPU_OPT_LEVEL", "XLA_FLAGS")}
    code = (
        "import json, sys\n"
        "from artifex.demos.addition import DemoConfig, run_demo\n"
        "config = DemoConfig(grpo_steps=40, warmup_target=0.45, out_dir=sys.argv[1])\n"
        "summary = run_demo(config, verbose=False)\n"
        "print('SUMMARY ' + json.dumps(summary))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True, text=True, timeout=900, env=env, check=False,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SUMMARY ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    summary = json.loads(lines[-1][len("SUMMARY ") :])
    # The warm-up stops at the first check with >= 45% validation accuracy (addition is learned
    # in a sudden jump: 600-900 supervised steps for seeds 0-2). From there 40 GRPO steps lift
    # held-out pass@1 by 0.19-0.31 (seed 0: 0.45 -> 0.76; seeds 1 and 2: 0.495 -> 0.68, 0.505 ->
    # 0.76; 2026-11-29). From the demo's 35% the gain comes later for some seeds (seed 1: 0.355
    # -> 0.425 after 30 steps), so a short run starts from 45%.
    assert summary["held_out_pass@1_after"] > summary["held_out_pass@1_before"] + 0.1
    assert summary["train_reward_last_10_steps"] > summary["train_reward_first_10_steps"]
    assert os.path.getsize(summary["reward_curve"]) > 1000


def test_compilation_cache_flag_writes_and_reuses_compiled_programs(tmp_path):
    import jax
    import jax.numpy as jnp

    from artifex.cli import DEFAULT_COMPILATION_CACHE, build_parser, enable_compilation_cache

    parser = build_parser()
    assert parser.parse_args(["demo"]).compilation_cache in (
        DEFAULT_COMPILATION_CACHE,
        os.environ.get("ARTIFEX_COMPILATION_CACHE"),
    )
    assert parser.parse_args(["demo", "--compilation-cache", "none"]).compilation_cache == "none"

    names = (
        "jax_enable_compilation_cache",
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    from jax._src import compilation_cache as cc  # the cache is set up once per process

    before = {n: getattr(jax.config, n) for n in names}
    cache = tmp_path / "cache"
    cc.reset_cache()
    try:
        assert enable_compilation_cache(None) is None
        assert enable_compilation_cache(str(cache)) == str(cache)
        assert jax.config.jax_compilation_cache_dir == str(cache)
        x = jnp.arange(7.0)
        jax.jit(lambda v: jnp.sin(v) * 3.0 + v.sum()).lower(x).compile()
        entries = sorted(cache.iterdir())
        assert entries, "no compiled program was written to the cache"
        # "none" turns the cache off even with a directory configured (as
        # JAX_COMPILATION_CACHE_DIR would), for a process that has not compiled yet.
        cc.reset_cache()
        assert enable_compilation_cache("none") is None
        assert jax.config.jax_compilation_cache_dir == str(cache)
        jax.jit(lambda v: jnp.cos(v) * 5.0 - v.max()).lower(x).compile()
        assert sorted(cache.iterdir()) == entries, "'none' still wrote to the cache"
    finally:
        for n, v in before.items():
            jax.config.update(n, v)
        cc.reset_cache()


def test_normalized_reward_mode_standardizes_within_each_prompts_group():
    """--reward-mode normalized takes its group size from --num-generations (GDPO rule)."""
    from artifex.cli import _build_rewards, build_parser

    args = build_parser().parse_args(
        ["train", "--model", "m", "--data", "d.jsonl", "--reward", "math", "--reward-mode",
         "normalized", "--num-generations", "2"]
    )  # fmt: skip
    rewards = _build_rewards(args, 2, 16)
    # Prompt 0's group is all correct-or-wrong pairs: (1, 0); prompt 1's group: (1, 1).
    prompts = ["p0", "p0", "p1", "p1"]
    completions = ["\\boxed{3}", "\\boxed{4}", "\\boxed{5}", "\\boxed{5}"]
    # The rollout passes the group size (GRPOConfig.num_generations) when it calls the
    # combiner (test_rollout.py checks that it does).
    out = rewards(prompts, completions, group_size=2, answer=["3", "3", "5", "5"])
    total = np.asarray(out.total, np.float64)
    # Within groups: (1, 0) standardizes to (+s, -s); the constant group (1, 1) gives zeros.
    # Over the whole batch (the old behaviour) the constant group would get positive values.
    assert total[0] > 0 > total[1]
    np.testing.assert_allclose(total[0], -total[1], rtol=1e-5)
    np.testing.assert_allclose(total[2:], 0.0, atol=1e-6)


def test_a_second_demo_run_in_the_same_directory_trains_afresh(tmp_path):
    # The first run leaves finished checkpoints behind: the second warms up a new model and
    # must train it, not resume the first run's (which left no step to run: an IndexError).
    cfg = DemoConfig(
        grpo_steps=1,
        prompts_per_step=4,
        num_eval=8,
        warmup_examples=64,
        warmup_max_steps=4,
        out_dir=str(tmp_path),
    )
    first = run_demo(cfg, verbose=False)
    second = run_demo(cfg, verbose=False)
    for summary in (first, second):
        assert 0.0 <= summary["held_out_pass@1_after"] <= 1.0
    # The log holds the second run's records only (one run writes 3: evaluations at steps 0
    # and 1, training step 1), not both runs' appended.
    with open(os.path.join(tmp_path, "logs", "metrics.jsonl")) as fh:
        steps = [json.loads(line).get("step") for line in fh if line.strip()]
    assert sorted(steps) == [0, 1, 1], steps


@pytest.mark.parametrize(
    ("backend", "precision", "dtype", "noted"),
    [
        ("cpu", "default", "float32", False),
        ("tpu", "default", "float32", False),
        ("gpu", "default", "float32", True),
        ("cuda", "default", "float32", True),
        ("gpu", "high", "float32", True),
        ("gpu", "tensorfloat32", "float32", True),
        ("gpu", "BF16_BF16_F32", "float32", True),
        ("gpu", "highest", "float32", False),
        ("gpu", "float32", "float32", False),
        ("gpu", "F32_F32_F32", "float32", False),
        ("gpu", "BF16_BF16_F32_X9", "float32", False),
        ("gpu", "default", "bfloat16", False),
    ],
)
def test_float32_precision_notice(model_dir, backend, precision, dtype, noted):
    from artifex.cli import float32_precision_notice

    model = CausalLM.from_pretrained(model_dir, dtype=dtype)
    notice = float32_precision_notice(model, backend, precision)
    assert (notice is not None) == noted
    if noted:
        assert "JAX_DEFAULT_MATMUL_PRECISION=highest" in notice
        assert repr(precision) in notice


def test_float32_precision_notice_reads_jax_setting(model_dir):
    import jax

    from artifex.cli import float32_precision_notice

    model = CausalLM.from_pretrained(model_dir)
    with jax.default_matmul_precision("highest"):
        assert float32_precision_notice(model, "gpu") is None
    with jax.default_matmul_precision("tensorfloat32"):
        assert float32_precision_notice(model, "gpu") is not None
