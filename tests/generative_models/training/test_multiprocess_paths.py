"""The multi-process code paths that can be checked in one process (the two-process runs are in
test_multihost.py): joining a run, each process's rows, and the data iterator's parts."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from artifex.cli import _setup_devices, build_parser
from artifex.generative_models.training import sharding
from artifex.generative_models.training.rl.loop import DataIterator
from artifex.generative_models.training.rl.rollout import spans_processes
from artifex.generative_models.training.sharding import (
    initialize_distributed,
    local_rows,
    make_mesh,
    process_row_range,
    rows_to_global,
    shard_batch,
)


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.append(kw))
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    return seen


def test_initialize_distributed_does_nothing_unless_asked(calls):
    assert initialize_distributed() is False
    assert calls == []
    assert initialize_distributed(auto=True) is True  # cluster auto-detection
    assert calls == [dict(coordinator_address=None, num_processes=None, process_id=None)]


def test_initialize_distributed_arguments_and_environment(calls, monkeypatch):
    assert initialize_distributed("10.0.0.1:1234", 2, 1)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.2:99")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert initialize_distributed()
    assert initialize_distributed(process_id=0)  # an argument wins over the environment
    assert calls == [
        dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1),
        dict(coordinator_address="10.0.0.2:99", num_processes=4, process_id=3),
        dict(coordinator_address="10.0.0.2:99", num_processes=4, process_id=0),
    ]
    with pytest.raises(ValueError, match="process_id"):
        initialize_distributed(process_id=4)
    with pytest.raises(ValueError, match="num_processes"):
        initialize_distributed(num_processes=0)


def test_cli_flags_join_the_run_and_build_the_mesh(calls, monkeypatch):
    # The command joins through the bounded handshake (rendezvous.join_processes), which then
    # calls jax.distributed.initialize; here it only records what it was asked.
    from artifex.generative_models.training import rendezvous

    def join(address, num_processes, process_id, timeout):
        calls.append(
            dict(coordinator_address=address, num_processes=num_processes, process_id=process_id)
        )
        joined.append(timeout)

    joined = []
    monkeypatch.setattr(rendezvous, "join_processes", join)
    base = ["train", "--model", "m", "--data", "d.jsonl", "--reward", "math"]
    join_flags = ["--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "0"]
    args = build_parser().parse_args([*base, *join_flags, "--mesh-fsdp", "2"])
    mesh = _setup_devices(args)
    assert calls == [dict(coordinator_address="h:1", num_processes=2, process_id=0)]
    assert joined == [args.distributed_timeout] and joined[0] > 0
    assert dict(mesh.shape) == {"data": 4, "fsdp": 2, "tensor": 1}  # 8 test devices
    plain = build_parser().parse_args(["train", "--model", "m", "--data", "d", "--reward", "math"])
    assert _setup_devices(plain) is None and len(calls) == 1


def test_local_rows_and_rows_to_global_in_one_process_are_the_whole_batch():
    mesh = make_mesh(data=2, fsdp=2, devices=jax.devices()[:4])
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    g = rows_to_global(x, mesh)
    assert g.sharding.spec == sharding.batch_partition_spec(mesh)
    np.testing.assert_array_equal(local_rows(g), x)
    np.testing.assert_array_equal(local_rows(x), x)
    assert process_row_range(8, mesh) == (0, 8)
    assert not spans_processes(mesh) and not spans_processes(None)
    # Replicated rows are counted once.
    rep = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    np.testing.assert_array_equal(local_rows(rep), x)
    np.testing.assert_array_equal(local_rows(shard_batch(x, mesh)), x)


@pytest.mark.parametrize("shuffle", [False, True])
def test_data_iterator_parts_partition_each_step_and_resume(shuffle):
    rows = [{"prompt": str(i)} for i in range(10)]
    whole = DataIterator(rows, seed=7, shuffle=shuffle)
    parts = [DataIterator(rows, seed=7, shuffle=shuffle) for _ in range(2)]
    for _ in range(7):  # crosses epochs (10 rows, 4 per step)
        expected = whole.take(4)
        got = parts[0].take(4, part=(0, 2)) + parts[1].take(4, part=(2, 4))
        assert got == expected
        assert parts[0].state() == parts[1].state() == whole.state()
    resumed = DataIterator(rows, seed=7, shuffle=shuffle)
    resumed.restore(parts[1].state())
    assert resumed.take(4, part=(2, 4)) == whole.take(4)[2:]
    with pytest.raises(ValueError, match="part"):
        whole.take(4, part=(3, 5))
