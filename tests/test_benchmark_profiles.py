"""The memory and cost scripts of ``benchmarks/`` run end to end on a tiny workload.

``benchmarks/profile_step.py`` (XLA's memory and cost analysis of the update) and
``benchmarks/host_rss.py`` (resident memory phase by phase) are run by hand on large workloads;
these tests keep them working as the library changes (``profile_step.py`` once failed after its
analysis when the step engines moved).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import hfdir, host_rss, profile_step  # noqa: E402

TINY = {
    "name": "Tiny",
    "num_prompts": 2,
    "num_generations": 2,
    "prompt_length": 6,
    "completion_length": 4,
    "beta": 0.04,
    "learning_rate": 1e-4,
    "seed": 0,
    "model": {
        "model_type": "qwen2",
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_layers": 2,
        "num_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 8,
        "tie_word_embeddings": True,
        "attention_bias": True,
        "max_position_embeddings": 64,
    },
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("workloads")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(hfdir.WORKLOADS, "tiny", TINY)
        return hfdir.ensure_dir("tiny", str(root))


def test_profile_step_reports_the_update_analysis_and_two_runs(tiny_dir, capsys):
    assert profile_step.main(["--dir", tiny_dir]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("PROFILE ")]
    record = json.loads(line[len("PROFILE ") :])
    update = record["update"]
    assert record["workload"] == "Tiny"
    # the state is the argument: parameters, AdamW moments (and step), reference
    assert update["argument_bytes"] >= record["params_bytes"] + record["optimizer_bytes"]
    assert update["temp_bytes"] > 0 and update["flops"] > 0
    assert update["first_run_s"] > 0 and update["second_run_s"] > 0


def test_host_rss_prints_the_compile_rollout_and_update_phases(tiny_dir, capsys):
    assert host_rss.main(["--dir", tiny_dir, "--steps", "1", "--no-remat", "--wait-compile"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("allocator environment")
    prefixes = ("loaded:", "update compiled", "step 0 rollout", "step 0 update")
    assert [x[: len(p)] for x, p in zip(lines[1:], prefixes, strict=True)] == list(prefixes)
    peaks = [float(x.split("peak ")[1].split(" GB")[0]) for x in lines[1:]]
    assert all(p > 0 for p in peaks) and peaks == sorted(peaks)  # a peak never falls
