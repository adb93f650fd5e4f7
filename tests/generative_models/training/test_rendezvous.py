"""Tests for artifex/generative_models/training/rendezvous.py (a bounded multi-process start)."""

from __future__ import annotations

import threading
import time

import pytest

from artifex.generative_models.training.rendezvous import (
    DistributedStartError,
    join_processes,
    parse_coordinator_address,
    wait_for_processes,
)
from tests.processes import free_port


@pytest.mark.parametrize(
    "address,expected",
    [
        ("10.0.0.1:1234", ("10.0.0.1", 1234)),
        ("node-7.cluster.local:8476", ("node-7.cluster.local", 8476)),
        ("[fe80::1]:65535", ("fe80::1", 65535)),
    ],
)
def test_good_addresses(address, expected):
    assert parse_coordinator_address(address) == expected


@pytest.mark.parametrize(
    "address,expected",
    [
        ("not_a_host:99999", "port 99999 is outside 1-65535"),
        ("host:0", "port 0 is outside"),
        ("host:http", "port http is outside"),
        ("under_score:80", "'under_score' is not an IP address or a valid host name"),
        ("-dash:80", "is not an IP address"),
        (":80", "expected host:port"),
        ("host", "expected host:port"),
    ],
)
def test_bad_addresses_are_named(address, expected):
    with pytest.raises(ValueError, match="--coordinator-address") as info:
        parse_coordinator_address(address)
    assert expected in str(info.value) and repr(address) in str(info.value)


def run_processes(ids, n, port, timeout, *, started=None):
    """Runs wait_for_processes for each id in its own thread; returns {id: error or None}."""
    results = {}

    def one(pid):
        try:
            wait_for_processes(
                f"127.0.0.1:{port}", n if started is None else started[pid], pid, timeout
            )
            results[pid] = None
        except Exception as err:
            results[pid] = err

    threads = [threading.Thread(target=one, args=(pid,)) for pid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_every_process_comes_and_all_go_on():
    results = run_processes([0, 1, 2], 3, free_port(), 20)
    assert results == {0: None, 1: None, 2: None}


def test_the_missing_process_is_named_by_every_waiting_one():
    port = free_port()
    start = time.monotonic()
    results = run_processes([0, 2], 4, port, 2)
    assert time.monotonic() - start < 20
    assert isinstance(results[0], DistributedStartError)
    assert f"processes 1, 3 did not join at 127.0.0.1:{port} within 2 s" in str(results[0])
    assert isinstance(results[2], DistributedStartError)
    assert "processes 1, 3 did not join" in str(results[2])  # told by process 0


def test_a_process_without_a_coordinator_says_so():
    with pytest.raises(DistributedStartError, match="no answer from process 0"):
        wait_for_processes(f"127.0.0.1:{free_port()}", 2, 1, 1.0)


def test_a_process_started_with_another_count_is_refused():
    results = run_processes([0, 1], 2, free_port(), 10, started={0: 2, 1: 3})
    assert "process 1 was started with --num-processes 3, process 0 with 2" in str(results[0])
    assert "process 1 was started with --num-processes 3" in str(results[1])


def test_join_processes_checks_waits_then_initializes_with_a_bounded_timeout():
    calls = []
    join_processes("127.0.0.1:1234", 1, 0, 7, initialize=lambda **kw: calls.append(kw))
    assert calls == [
        {
            "coordinator_address": "127.0.0.1:1234",
            "num_processes": 1,
            "process_id": 0,
            "initialization_timeout": 37,
        }
    ]
    with pytest.raises(ValueError, match=r"cannot resolve the host 'no-such-host\.invalid'"):
        join_processes("no-such-host.invalid:1234", 1, 0, 5, initialize=calls.append)
    with pytest.raises(ValueError, match="--distributed-timeout must be a number of seconds"):
        join_processes("127.0.0.1:1234", 1, 0, 0, initialize=calls.append)
    assert len(calls) == 1
