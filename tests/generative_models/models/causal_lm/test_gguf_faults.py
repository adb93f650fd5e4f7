"""GGUF conversion against bad files and lost or mixed-up output (a hostile-input sweep).

A directory holding another model is refused without ``--overwrite`` and replaced whole with
it; more tokens than embedding rows and NaN weights are refused; a killed conversion leaves no
temporary behind after the next one, and a completed write of a file removes the temporaries
of it that killed writers left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import load_file

from artifex.cli import main as cli_main
from artifex.generative_models.models.causal_lm import CausalLM, Tokenizer, convert_gguf
from artifex.generative_models.utils.atomic import TEMP_MARKER, atomic_write, remove_temp_files
from tests.fixtures.make_tiny_gguf import TOKENS, write_gguf

from ._helpers import FIXTURES

pytest.importorskip("gguf")


def gone_pid() -> int:
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


def temporaries(*directories):
    return [n for d in directories if os.path.isdir(d) for n in os.listdir(d) if TEMP_MARKER in n]


# ------------------------------------------------------------------ 5: another model's directory
def test_a_directory_holding_another_model_is_refused_then_replaced_whole(tmp_path, capsys):
    qwen = write_gguf(tmp_path / "qwen.gguf", "qwen2_tiny")
    llama = write_gguf(tmp_path / "llama.gguf", "llama3_tiny")
    out = tmp_path / "hf"
    assert cli_main(["convert", str(qwen), str(out)]) == 0
    (out / "chat_template.jinja").write_text("{{ 'the old model template' }}")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old shard")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()

    assert cli_main(["convert", str(llama), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"output {out} is not empty" in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched

    assert cli_main(["convert", str(llama), str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert CausalLM.from_pretrained(out).config.model_type == "llama"
    assert "the old model template" not in (Tokenizer.from_pretrained(out).chat_template or "")
    assert temporaries(tmp_path, out) == []


def test_overwrite_replaces_only_a_model_directory(tmp_path):
    qwen = write_gguf(tmp_path / "qwen.gguf", "qwen2_tiny")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("years of work")
    with pytest.raises(ValueError, match=r"holds no config\.json, so it is not a model directory"):
        convert_gguf(qwen, notes, overwrite=True)
    assert (notes / "thesis.tex").read_text() == "years of work"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert convert_gguf(qwen, empty) == str(empty)  # an empty directory needs no --overwrite


# ------------------------------------------------------------------ 11: bad files
def test_more_tokens_than_embedding_rows_is_refused(tmp_path):
    hf = load_file(str(FIXTURES / "qwen2_tiny" / "model.safetensors"))
    rows = len(TOKENS) - 5
    hf["model.embed_tokens.weight"] = hf["model.embed_tokens.weight"][:rows]
    path = write_gguf(tmp_path / "short.gguf", "qwen2_tiny", tensors=hf)
    with pytest.raises(ValueError, match=rf"{len(TOKENS)} tokens .* only {rows} rows") as info:
        convert_gguf(path, tmp_path / "hf")
    assert str(path) in str(info.value) and "token_embd.weight" in str(info.value)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, capsys, bad):
    hf = load_file(str(FIXTURES / "qwen2_tiny" / "model.safetensors"))
    weight = hf["model.layers.1.mlp.down_proj.weight"].astype(np.float32)
    weight[3, 5] = bad
    hf["model.layers.1.mlp.down_proj.weight"] = weight
    path = write_gguf(tmp_path / "nan.gguf", "qwen2_tiny", tensors=hf)
    out = tmp_path / "hf"
    assert cli_main(["convert", str(path), str(out)]) == 2
    err = capsys.readouterr().err
    assert "tensor 'blk.1.ffn_down.weight' holds 1 NaN or infinite values" in err
    assert not out.exists() and temporaries(tmp_path) == []


# ------------------------------------------------------------------ 11: temporaries
KILLED = textwrap.dedent(
    """
    import sys, time
    from artifex.generative_models.models.causal_lm import hf_io

    def stuck(tensors, path, metadata=None):
        with open(path, "wb") as fh:
            fh.write(b"x" * 100_000)  # a partly written weight file
        print("writing", flush=True)
        time.sleep(60)

    hf_io.save_file = stuck
    from artifex.generative_models.models.causal_lm import convert_gguf
    convert_gguf(sys.argv[1], sys.argv[2], overwrite=True)
    """
)


def test_a_killed_conversion_leaves_nothing_after_the_next_one(tmp_path):
    qwen = write_gguf(tmp_path / "qwen.gguf", "qwen2_tiny")
    out = tmp_path / "hf"
    convert_gguf(qwen, out)
    before = (out / "model.safetensors").read_bytes()
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(qwen), str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.kill()
        proc.wait()
    assert temporaries(tmp_path, out)  # the killed conversion's staging directory
    assert (out / "model.safetensors").read_bytes() == before  # the old model is intact
    convert_gguf(qwen, out, overwrite=True)
    assert temporaries(tmp_path, out) == []


def test_a_completed_write_removes_the_temporaries_killed_writes_of_that_file_left(tmp_path):
    pid = gone_pid()
    stale = tmp_path / f".tokenizer.json{TEMP_MARKER}{pid}-0a1b"
    stale.write_bytes(b"x" * 1000)  # left by a killed Tokenizer.save_pretrained
    other = tmp_path / f".config.json{TEMP_MARKER}{pid}-0a1b"
    other.write_bytes(b"x")
    Tokenizer.for_characters("0123456789").save_pretrained(str(tmp_path))
    assert not stale.exists()
    assert other.exists()  # another file's: removed by that file's next write
    with atomic_write(tmp_path / "config.json") as fh:
        json.dump({}, fh)
    assert not other.exists()


def test_a_temporary_of_a_write_in_progress_is_kept(tmp_path):
    hold = "import sys, time; print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        live = tmp_path / f".model.safetensors{TEMP_MARKER}{proc.pid}-0a1b"
        live.write_bytes(b"being written")
        dead = tmp_path / f".model.safetensors{TEMP_MARKER}{gone_pid()}-0a1b"
        dead.write_bytes(b"left by a kill")
        assert remove_temp_files(tmp_path) == [dead.name]
        assert live.exists()
    finally:
        proc.kill()
        proc.wait()
