"""``artifex-grpo train`` data: CSV, ``--data-format``, real ``save_to_disk`` and ``load_dataset``.

The tests with the real ``datasets`` package skip where it is not installed (the ``[datasets]``
extra); they read local files only, offline (``HF_DATASETS_OFFLINE=1``, a temporary cache).
"""

from __future__ import annotations

import builtins
import json

import pytest

from artifex.cli import load_rows, main
from artifex.demos.addition import demo_model, demo_tokenizer
from artifex.generative_models.training.rl.dataset_rows import EVAL_SPLITS
from tests.generative_models.training.rl.test_dataset_rows import ROWS, _write, hf_datasets

__all__ = ["hf_datasets"]  # the fixture, imported for these tests

CHAT = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
        for r in ROWS]  # fmt: skip


# ------------------------------------------------------------------------------ CSV, formats
def test_csv_files_are_read_with_their_column_types(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "rows.csv"
    path.write_text('prompt,answer,note\n"1+2=",3,"a, b"\n"9+9=",18,\n')
    assert load_rows(str(path)) == [
        {"prompt": "1+2=", "answer": 3, "note": "a, b"},
        {"prompt": "9+9=", "answer": 18, "note": ""},
    ]
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt,answer\n1+2=,3,extra\n")
    with pytest.raises(ValueError, match=r"bad.csv: cannot read the CSV file \(.*\): check the"):
        load_rows(str(bad))


def test_data_format_names_the_reader(tmp_path):
    path = tmp_path / "rows.data"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(ValueError, match=r"unknown dataset format .* name the format with "
                                         r"--data-format \(jsonl, json, csv"):  # fmt: skip
        load_rows(str(path))
    assert load_rows(str(path), data_format="jsonl") == ROWS
    with pytest.raises(ValueError, match=r"rows.data:2: invalid JSON \(Extra data"):
        load_rows(str(path), data_format="json")  # one array expected, JSON Lines found
    with pytest.raises(ValueError, match=r"is a directory: --data-format jsonl reads a file"):
        load_rows(str(tmp_path), data_format="jsonl")
    with pytest.raises(ValueError, match=r"is a file: --data-format save_to_disk reads a dir"):
        load_rows(str(path), data_format="save_to_disk")
    with pytest.raises(FileNotFoundError, match=r"dataset directory not found"):
        load_rows(str(tmp_path / "gone"), data_format="save_to_disk")
    with pytest.raises(ValueError, match=r"unknown data format 'xml'"):
        load_rows(str(path), data_format="xml")


def test_load_dataset_format_needs_the_package(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(ImportError, match=r"load_dataset needs the datasets package: pip install "
                                          r"'artifex-grpo\[datasets\]'"):  # fmt: skip
        load_rows(str(tmp_path / "rows.jsonl"), data_format="load_dataset")


# ------------------------------------------------------------------------------ real datasets
def test_real_save_to_disk_directories_are_read_without_datasets(hf_datasets, tmp_path):
    hf_datasets.Dataset.from_list(CHAT).save_to_disk(str(tmp_path / "one"), num_shards=3)
    assert load_rows(str(tmp_path / "one")) == CHAT  # pyarrow reads datasets' own files
    splits = hf_datasets.DatasetDict(
        train=hf_datasets.Dataset.from_list(CHAT[:5]),
        validation=hf_datasets.Dataset.from_list(CHAT[5:]),
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    assert load_rows(str(tmp_path / "dict")) == CHAT[:5]
    assert load_rows(str(tmp_path / "dict"), split="validation") == CHAT[5:]
    with pytest.raises(ValueError, match=r"no split 'test' \(--split\); its splits are"):
        load_rows(str(tmp_path / "dict"), split="test")


def test_a_saved_shuffled_and_selected_view_reads_as_its_rows(hf_datasets, tmp_path):
    view = hf_datasets.Dataset.from_list(ROWS).shuffle(seed=1).select([5, 0, 3])
    view.save_to_disk(str(tmp_path / "view"))  # datasets writes the view's rows, in its order
    expected = [view[i] for i in range(3)]
    assert len({r["prompt"] for r in expected}) == 3 and expected != ROWS[:3]
    assert load_rows(str(tmp_path / "view")) == expected


def test_load_dataset_reads_files_and_directories_of_splits(hf_datasets, tmp_path):
    paths = _write(tmp_path, ROWS)
    assert load_rows(str(paths["json"]), data_format="load_dataset") == ROWS
    assert load_rows(str(paths["parquet"]), data_format="load_dataset") == ROWS
    csv_rows = load_rows(str(paths["csv"]), data_format="load_dataset")
    assert csv_rows == [r | {"answer": int(r["answer"])} for r in ROWS]  # datasets' CSV types
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:6]))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[6:]))
    assert load_rows(str(folder), data_format="load_dataset") == ROWS[:6]
    held_out = load_rows(str(folder), data_format="load_dataset", default_splits=EVAL_SPLITS)
    assert held_out == ROWS[6:]
    assert load_rows(str(folder), "test", data_format="load_dataset") == ROWS[6:]
    with pytest.raises(ValueError, match=r"has no split 'dev' \(--split\); its splits are"):
        load_rows(str(folder), "dev", data_format="load_dataset")
    other = tmp_path / "rows.xml"
    other.write_text("<rows/>")
    with pytest.raises(ValueError, match=r"rows.xml: load_dataset reads .arrow, .csv"):
        load_rows(str(other), data_format="load_dataset")
    with pytest.raises(ValueError, match=r"gone: datasets.load_dataset failed"):
        load_rows(str(tmp_path / "gone"), data_format="load_dataset")


@pytest.mark.slow
def test_train_on_a_csv_file_and_a_load_dataset_folder(hf_datasets, tmp_path):
    tok = demo_tokenizer()
    model_dir = tmp_path / "model"
    demo_model(tok).save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))
    paths = _write(tmp_path, ROWS)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    (folder / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[4:6]))
    out = tmp_path / "run"
    rc = main(
        ["train", "--model", str(model_dir), "--data", str(paths["csv"]),
         "--eval-data", str(folder), "--eval-data-format", "load_dataset",
         "--output", str(out / "model"), "--reward", "math", "--num-steps", "1",
         "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "3",
         "--progress", "false", "--log-completions-every", "1", "--completions-to-print", "0"]
    )  # fmt: skip
    assert rc == 0
    records = [json.loads(x) for x in (out / "logs" / "completions.jsonl").read_text().split("\n")
               if x]  # fmt: skip
    assert len(records) == 4 and {r["prompt"] for r in records} <= {r["prompt"] for r in ROWS}
    metrics = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "eval/pass@1" in m] == [0, 1]  # the validation split
