"""Datasets as users have them: lists of rows and Hugging Face ``datasets`` objects in ``train``.

The tests with the real ``datasets`` package skip where it is not installed (the ``[datasets]``
extra installs it; ``.ci/run`` does). They read local files only, with ``HF_DATASETS_OFFLINE=1``
and a temporary cache: nothing is downloaded.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.demos.addition import demo_model, demo_tokenizer
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl.dataset_rows import EVAL_SPLITS, as_rows
from artifex.generative_models.training.rl.loop import TrainConfig, dataset_fingerprint, train
from artifex.generative_models.training.rl.rollout import RolloutConfig

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "level": a % 3}
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 1), (2, 2), (4, 4), (6, 1), (8, 0)]]  # fmt: skip


@pytest.fixture()
def hf_datasets(tmp_path, monkeypatch):
    """The real ``datasets`` package, offline, with its cache in a temporary directory."""
    datasets = pytest.importorskip("datasets", reason="datasets is not installed ([datasets])")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    return datasets


# ------------------------------------------------------------------------------ without datasets
def test_lists_pass_through_and_other_objects_are_type_errors():
    assert as_rows(ROWS) is ROWS
    assert as_rows(tuple(ROWS)) == tuple(ROWS)
    with pytest.raises(TypeError, match=r"dataset must be rows the loop can index .* a generator"):
        as_rows(r for r in ROWS)
    with pytest.raises(TypeError, match=r"eval_dataset must be rows .* got a dict"):
        as_rows({"train": ROWS}, what="eval_dataset")
    with pytest.raises(TypeError, match=r"split='train' is for a datasets.DatasetDict, got a list"):
        as_rows(ROWS, split="train")


def _fake(kind, module):
    """A class named and placed as ``datasets`` names and places its own."""
    return type(kind, (dict,), {"__module__": module})


def test_dataset_dict_splits_are_chosen_like_the_command_line_chooses_them():
    # DatasetDict is a dict subclass of datasets.dataset_dict; its values here are plain lists.
    DatasetDict = _fake("DatasetDict", "datasets.dataset_dict")
    both = DatasetDict(train=ROWS[:4], test=ROWS[4:], validation=ROWS[:1])
    assert as_rows(both) == ROWS[:4]
    assert as_rows(both, default_splits=EVAL_SPLITS, what="eval_dataset") == ROWS[4:]
    assert as_rows(DatasetDict(validation=ROWS), default_splits=EVAL_SPLITS) == ROWS
    assert as_rows(DatasetDict(only=ROWS)) == ROWS
    assert as_rows(both, split="validation") == ROWS[:1]
    with pytest.raises(ValueError, match=r"dataset has no split 'dev'; its splits are"):
        as_rows(both, split="dev")
    with pytest.raises(ValueError, match=r"splits \['a', 'b'\] and none of \['train'\]: pass one"):
        as_rows(DatasetDict(a=ROWS, b=ROWS))
    Streamed = _fake("IterableDatasetDict", "datasets.dataset_dict")
    with pytest.raises(TypeError, match=r"datasets.IterableDatasetDict \(streamed\).*streaming"):
        as_rows(Streamed(train=ROWS))


# ------------------------------------------------------------------------------ real datasets
def _write(tmp_path, rows):
    """The rows as JSON Lines, Parquet and CSV files."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    paths = {"json": tmp_path / "rows.jsonl", "parquet": tmp_path / "rows.parquet",
             "csv": tmp_path / "rows.csv"}  # fmt: skip
    paths["json"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), paths["parquet"])
    pacsv.write_csv(pa.Table.from_pylist(rows), paths["csv"])
    return paths


@pytest.mark.parametrize("builder", ["json", "parquet", "csv"])
def test_load_dataset_objects_give_the_rows_of_the_files(hf_datasets, tmp_path, builder):
    path = str(_write(tmp_path, ROWS)[builder])
    expected = ROWS
    if builder == "csv":  # CSV has no types: datasets infers them (an answer "3" is an int)
        expected = [r | {"answer": int(r["answer"])} for r in ROWS]
    whole = hf_datasets.load_dataset(builder, data_files=path)  # a DatasetDict: train
    assert list(as_rows(whole)) == expected
    assert list(as_rows(whole, default_splits=EVAL_SPLITS)) == expected  # the only split
    one = hf_datasets.load_dataset(builder, data_files=path, split="train")  # a Dataset
    rows = as_rows(one)
    assert len(rows) == len(expected) and rows[3] == expected[3] and list(rows) == expected
    assert dataset_fingerprint(rows) == dataset_fingerprint(expected)  # resumable either way


def test_a_formatted_dataset_gives_python_values(hf_datasets):
    ds = hf_datasets.Dataset.from_list(ROWS).with_format("numpy")
    assert isinstance(ds[0]["level"], np.integer)
    rows = as_rows(ds)
    assert rows[0] == ROWS[0] and type(rows[0]["level"]) is int and type(rows[0]["prompt"]) is str


def test_saved_datasets_load_from_disk(hf_datasets, tmp_path):
    chat = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in ROWS]  # fmt: skip
    hf_datasets.Dataset.from_list(chat).save_to_disk(str(tmp_path / "one"), num_shards=2)
    assert list(as_rows(hf_datasets.load_from_disk(str(tmp_path / "one")))) == chat
    splits = hf_datasets.DatasetDict(
        train=hf_datasets.Dataset.from_list(chat[:6]),
        test=hf_datasets.Dataset.from_list(chat[6:]),
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    loaded = hf_datasets.load_from_disk(str(tmp_path / "dict"))
    assert list(as_rows(loaded)) == chat[:6]
    assert list(as_rows(loaded, default_splits=EVAL_SPLITS, what="eval_dataset")) == chat[6:]


def test_streamed_datasets_are_refused(hf_datasets, tmp_path):
    path = str(_write(tmp_path, ROWS)["json"])
    streamed = hf_datasets.load_dataset("json", data_files=path, split="train", streaming=True)
    with pytest.raises(TypeError, match=r"datasets.IterableDataset \(streamed\).*streaming=True"):
        as_rows(streamed)


def _trainer():
    tok = demo_tokenizer()
    model = demo_model(tok, seed=0)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    return GRPOTrainer(model, opt, GRPOConfig(num_generations=2, beta=0.0)), tok


def _run(dataset, eval_dataset=None):
    """Two steps; what the reward function and the evaluation were given, and the parameters."""
    seen, evaluated = [], []

    def reward(prompts, completions, answer, level, **columns):
        seen.append((list(prompts), list(answer), list(level)))
        return [float(sum(map(ord, c)) % 5) for c in completions]

    def evaluate_fn(policy, tokenizer, rows, *args, **kwargs):
        evaluated.append([dict(r) for r in rows])
        return {"eval/pass@1": 0.0}

    trainer, tok = _trainer()
    config = TrainConfig(num_steps=2, prompts_per_step=2, progress=False, compile_ahead=False)
    result = train(trainer, tok, dataset, [reward], config, RolloutConfig(max_new_tokens=2),
                   eval_dataset=eval_dataset, evaluate_fn=evaluate_fn)  # fmt: skip
    params = [np.asarray(x) for x in jax.tree.leaves(nnx.state(trainer.model, nnx.Param))]
    return seen, evaluated, result.history, params


@pytest.mark.slow
def test_the_loop_trains_on_a_dataset_dict_as_on_its_rows(hf_datasets, tmp_path):
    path = str(_write(tmp_path, ROWS)["parquet"])
    splits = hf_datasets.load_dataset("parquet", data_files={"train": path, "test": path})
    splits["test"] = splits["test"].select(range(2))
    got = _run(splits, eval_dataset=splits)  # the train split; the test split held out
    want = _run(ROWS, eval_dataset=ROWS[:2])
    assert got[0] == want[0]  # the reward function saw the same prompts and columns
    assert got[0] and all(isinstance(a, str) for _, answers, _ in got[0] for a in answers)
    assert got[1] == want[1] == [ROWS[:2]] * 2  # evaluated before the first step and at the end
    assert [h["reward_mean"] for h in got[2]] == [h["reward_mean"] for h in want[2]]
    for a, b in zip(got[3], want[3], strict=True):
        np.testing.assert_array_equal(a, b)
