"""artifex-grpo train: import-path rewards, --config files, datasets directories, chat prompts."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from artifex.cli import _build_rewards, _expand_config, build_parser, load_rows, main
from artifex.demos.addition import addition_dataset, demo_model
from artifex.generative_models.models.causal_lm import Tokenizer

pa = pytest.importorskip("pyarrow")

BASE = ["train", "--model", "m", "--data", "d.jsonl"]

REWARD_MODULE = """
def exact_match(prompts, completions, answer, **columns):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

NOT_A_FUNCTION = 3
"""


@pytest.fixture()
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(REWARD_MODULE)
    monkeypatch.chdir(tmp_path)  # the current directory is importable, as for tools
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards_mod"


def _parse(*extra):
    return build_parser().parse_args([*BASE, *extra])


# ------------------------------------------------------------------------------ --reward
def test_reward_by_import_path_with_weights(reward_module):
    args = _parse("--reward", "math", "--reward", f"{reward_module}:exact_match",
                  "--reward-weights", "1", "0.5")  # fmt: skip
    combiner = _build_rewards(args, 2, 8)
    assert combiner.names == ["math_answer_reward", "exact_match"]
    total, per_function = combiner(["1+2=", "1+2="], ["3", "\\boxed{4}"], answer=["3", "3"])
    np.testing.assert_allclose(np.asarray(per_function)[:, 1], [1.0, 0.0])
    np.testing.assert_allclose(
        np.asarray(total), np.nansum(np.asarray(per_function) * [1.0, 0.5], axis=1)
    )


@pytest.mark.parametrize(
    ("extraction", "expected"),
    [("markers", [0.0, 1.0, 0.0]), ("last_number", [1.0, 1.0, 0.0])],
)
def test_answer_extraction_flag_reaches_the_math_reward(extraction, expected):
    # "3 + 4 = 7" has no marker: only the last-number mode reads its answer.
    args = _parse("--reward", "math", "--answer-extraction", extraction)
    total, _ = _build_rewards(args, 3, 8)(
        ["q"] * 3, ["3 + 4 = 7", "\\boxed{7}", "7 is 3 + 4"], answer=["7"] * 3
    )
    np.testing.assert_allclose(np.asarray(total), expected)


def test_answer_extraction_rejects_unknown_modes(capsys):
    with pytest.raises(SystemExit):
        _parse("--answer-extraction", "first_number")
    assert "--answer-extraction: invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("spec", "error", "text"),
    [
        ("no_such_module_xyz:f", ImportError, "--reward 'no_such_module_xyz:f': cannot import"),
        ("{mod}:missing", ValueError, "--reward '{mod}:missing': module"),
        ("{mod}:NOT_A_FUNCTION", TypeError, "is a int, not a function"),
    ],
)
def test_bad_reward_import_paths_name_the_flag(reward_module, spec, error, text):
    args = _parse("--reward", spec.format(mod=reward_module))
    with pytest.raises(error) as info:
        _build_rewards(args, 2, 8)
    assert text.format(mod=reward_module) in str(info.value)


def test_unknown_reward_name_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as info:
        _parse("--reward", "exact")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --reward: unknown reward 'exact'" in err
    assert len(err.strip().splitlines()) == 1


def test_reward_weights_must_match_the_rewards():
    args = _parse("--reward", "math", "--reward", "format", "--reward-weights", "1")
    with pytest.raises(ValueError, match="--reward-weights has 1 values for 2 --reward"):
        _build_rewards(args, 2, 8)


# ------------------------------------------------------------------------------ --config
def _write(path, text):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("kind", ["yaml", "json"])
def test_config_file_supplies_options_and_flags_override_it(tmp_path, kind):
    values = {
        "model": "m",
        "data": "d.jsonl",
        "reward": ["math", "format"],
        "reward_weights": [1, 0.25],
        "num-steps": 7,
        "beta": 0.04,
        "overwrite": True,
        "top_k": None,
        "log_completions_every": 5,
    }
    if kind == "yaml":
        import yaml

        path = _write(tmp_path / "run.yaml", yaml.safe_dump(values))
    else:
        path = _write(tmp_path / "run.json", json.dumps(values))
    parser = build_parser()
    args = parser.parse_args(_expand_config(parser, ["train", "--config", path]))
    assert (args.model, args.data, args.reward, args.reward_weights) == (
        "m", "d.jsonl", ["math", "format"], [1.0, 0.25]
    )  # fmt: skip
    assert getattr(args, "TrainConfig.num_steps") == 7
    assert getattr(args, "GRPOConfig.beta") == 0.04
    assert getattr(args, "TrainConfig.overwrite") is True
    assert getattr(args, "RolloutConfig.top_k") is None
    assert getattr(args, "TrainConfig.log_completions_every") == 5
    argv = ["train", f"--config={path}", "--beta", "0.1", "--reward", "math", "--num-steps", "2"]
    args = parser.parse_args(_expand_config(parser, argv))
    assert getattr(args, "GRPOConfig.beta") == 0.1
    assert getattr(args, "TrainConfig.num_steps") == 2
    assert args.reward == ["math"]  # the command line's list replaces the file's
    assert args.reward_weights == [1.0, 0.25]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "run.yaml",
            "model: m\nbetta: 0.1\n",
            "run.yaml: unknown key 'betta' (did you mean 'beta'?)",
        ),
        ("run.json", '{"model": "m", "no_such": 1}', "run.json: unknown key 'no_such'"),
        ("run.yaml", "beta: lots\n", "run.yaml: key 'beta': not a float (got 'lots')"),
        ("run.yaml", "learning_rate: -1\n", "run.yaml: key 'learning_rate': must be a finite"),
        ("run.yaml", "reward: [math, nope]\n", "run.yaml: key 'reward': unknown reward 'nope'"),
        ("run.yaml", "loss_aggregation: mean\n", "key 'loss_aggregation': 'mean' is not one of"),
        ("run.yaml", "model: m\nbeta: [1\n", "run.yaml:3: invalid YAML"),
        ("run.json", '{"model": "m",\n "beta": }', "run.json:2: invalid JSON"),
        ("run.yaml", "- model\n", "run.yaml: expected a mapping of option names"),
        ("run.toml", "model = 1\n", "unknown config file format"),
    ],
)
def test_config_file_errors_name_the_file_and_key(tmp_path, capsys, name, text, message):
    path = _write(tmp_path / name, text)
    rc = main(["train", "--config", path])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------ datasets
ROWS = [
    {"prompt": [{"role": "user", "content": "12+30"}], "answer": "42"},
    {"prompt": [{"role": "user", "content": "1+2"}], "answer": "3"},
]


def _save_dataset(directory, rows):
    """The layout of datasets' Dataset.save_to_disk: Arrow stream files listed in state.json."""
    os.makedirs(directory)
    table = pa.Table.from_pylist(rows)
    name = "data-00000-of-00001.arrow"
    with (
        pa.OSFile(os.path.join(directory, name), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as writer,
    ):
        writer.write_table(table)
    state = {
        "_data_files": [{"filename": name}],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    with open(os.path.join(directory, "state.json"), "w") as fh:
        json.dump(state, fh)
    with open(os.path.join(directory, "dataset_info.json"), "w") as fh:
        json.dump({"citation": "", "description": "", "features": {}}, fh)


def _save_dataset_dict(directory, splits):
    os.makedirs(directory)
    with open(os.path.join(directory, "dataset_dict.json"), "w") as fh:
        json.dump({"splits": list(splits)}, fh)
    for name, rows in splits.items():
        _save_dataset(os.path.join(directory, name), rows)


def _save_with_datasets_if_installed(directory, rows):
    try:
        import datasets
    except ImportError:
        _save_dataset(directory, rows)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(directory)


def test_load_rows_reads_a_saved_dataset_with_chat_messages(tmp_path):
    path = str(tmp_path / "ds")
    _save_with_datasets_if_installed(path, ROWS)
    assert load_rows(path) == ROWS
    with pytest.raises(ValueError, match="applies to a DatasetDict"):
        load_rows(path, split="train")


def test_load_rows_also_reads_the_arrow_file_format(tmp_path):
    path = tmp_path / "ds"
    _save_dataset(str(path), ROWS)
    table = pa.Table.from_pylist(ROWS)
    with pa.ipc.new_file(str(path / "data-00000-of-00001.arrow"), table.schema) as writer:
        writer.write_table(table)
    assert load_rows(str(path)) == ROWS
    (path / "data-00000-of-00001.arrow").write_bytes(b"not arrow")
    with pytest.raises(ValueError, match=r"data-00000-of-00001.arrow: cannot read the Arrow"):
        load_rows(str(path))


def test_load_rows_reads_a_split_of_a_dataset_dict(tmp_path):
    path = str(tmp_path / "dd")
    _save_dataset_dict(path, {"train": ROWS, "test": ROWS[:1]})
    assert load_rows(path) == ROWS  # train by default
    assert load_rows(path, split="test") == ROWS[:1]
    with pytest.raises(ValueError, match=r"no split 'validation' \(--split\); its splits are"):
        load_rows(path, split="validation")
    two = str(tmp_path / "dd2")
    _save_dataset_dict(two, {"a": ROWS, "b": ROWS})
    with pytest.raises(ValueError, match="choose one with --split"):
        load_rows(two)


def test_eval_data_defaults_to_the_test_or_validation_split(tmp_path):
    from artifex.cli import _eval_split

    for splits, expected in [(("train", "test"), "test"), (("train", "validation"), "validation"),
                             (("only",), "only")]:  # fmt: skip
        path = tmp_path / "_".join(splits)
        _save_dataset_dict(str(path), dict.fromkeys(splits, ROWS))
        assert _eval_split(str(path)) == expected
    _save_dataset_dict(str(tmp_path / "ab"), {"a": ROWS, "b": ROWS})
    with pytest.raises(ValueError, match="choose one with --eval-split"):
        _eval_split(str(tmp_path / "ab"))
    assert _eval_split(str(tmp_path / "rows.jsonl")) is None


def test_load_rows_rejects_other_directories_and_names_bad_lines(tmp_path):
    with pytest.raises(ValueError, match="not a dataset written by datasets' save_to_disk"):
        load_rows(str(tmp_path))
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"prompt": "1+2="}\n\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:3: invalid JSON"):
        load_rows(str(bad))
    bad.write_bytes(b'{"prompt": "1+2="}\n{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: not UTF-8"):
        load_rows(str(bad))
    bad = tmp_path / "rows.json"
    bad.write_text('[\n{"prompt": "1"},\n{"prompt": }\n]')
    with pytest.raises(ValueError, match=r"rows.json:3: invalid JSON"):
        load_rows(str(bad))


# ------------------------------------------------------------------------------ end to end
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)


@pytest.fixture()
def chat_model_dir(tmp_path):
    tok = Tokenizer.for_characters("0123456789+=", chat_template=TEMPLATE)
    path = tmp_path / "model"
    demo_model(tok).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


def _run(tmp_path, model_dir, data, *extra):
    out = tmp_path / "out"
    rc = main(
        [
            "train", "--model", model_dir, "--data", data, "--output", str(out / "model"),
            "--num-steps", "1", "--prompts-per-step", "2", "--num-generations", "2",
            "--max-new-tokens", "3", "--progress", "false", "--log-completions-every", "1",
            "--completions-to-print", "2", *extra,
        ]
    )  # fmt: skip
    lines = (out / "logs" / "completions.jsonl").read_text().splitlines()
    return rc, [json.loads(line) for line in lines]


def test_train_from_a_dataset_dict_with_chat_prompts_and_a_custom_reward(
    tmp_path, chat_model_dir, reward_module, capsys
):
    rows, _ = addition_dataset(num_eval=4)
    chat = [{"prompt": [{"role": "user", "content": r["prompt"][:-1]}], "answer": r["answer"]}
            for r in rows[:8]]  # fmt: skip
    data = str(tmp_path / "dd")
    _save_dataset_dict(data, {"train": chat, "test": chat[:2]})
    config = _write(
        tmp_path / "run.yaml",
        f"reward: ['{reward_module}:exact_match']\nsplit: train\nbeta: 0.0\n",
    )
    rc, records = _run(tmp_path, chat_model_dir, data, "--config", config, "--eval-data", data)
    assert rc == 0
    assert len(records) == 4 and all(set(r["rewards"]) == {"exact_match"} for r in records)
    contents = {m[0]["content"] + "=" for m in (row["prompt"] for row in chat)}
    assert {r["prompt"] for r in records} <= contents  # rendered by the chat template
    out = capsys.readouterr().out
    assert "completions at step 1 (2 of 4" in out and "exact_match" in out


@pytest.mark.parametrize("apply", [False, True])
def test_plain_text_prompts_use_the_chat_template_only_when_asked(tmp_path, chat_model_dir, apply):
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{a}+1", "answer": "0"}) + "\n" for a in range(4))
    )
    extra = ["--apply-chat-template"] if apply else []
    rc, records = _run(tmp_path, chat_model_dir, str(data), "--reward", "math", *extra)
    assert rc == 0
    assert all(r["prompt"].endswith("=") == apply for r in records)


def test_chat_prompts_need_a_chat_template(tmp_path, capsys):
    tok = Tokenizer.for_characters("0123456789+=")
    model_dir = tmp_path / "model"
    demo_model(tok).save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n")
    rc = main(["train", "--model", str(model_dir), "--data", str(data), "--reward", "math",
               "--num-steps", "1", "--output", str(tmp_path / "o" / "m")])  # fmt: skip
    assert rc == 2
    assert "--data row 0: column 'prompt' holds chat messages" in capsys.readouterr().err
