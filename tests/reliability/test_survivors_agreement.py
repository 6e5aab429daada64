"""The survivors' agreement after a failure (`membership.agree_on_survivors`), on a real
TCPStore: a member whose heartbeat still moves is waited for however late it registers
(a survivor slow to notice the failure is not dropped), and a member whose heartbeat
stopped is counted as lost once it has not moved for `dead_after` seconds; a heartbeat
the store no longer answers (its host unreachable) is reported within a bound.

Each member is a thread of this process with its own store connection, as each replica
has; the heartbeats are real `Heartbeat` threads raising their counters every 0.05 s."""
import datetime
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from torchstrategy.fault_tolerance.membership import (Heartbeat, agree_on_survivors,
                                                      agreement_begun)

JOB = "job/"
DEAD_AFTER = 0.5


@pytest.fixture
def server():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True,
                           timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    yield server


def _client(server):
    return dist.TCPStore("127.0.0.1", server.port, is_master=False,
                         timeout=datetime.timedelta(seconds=10))


def _agree(server, uid, members, results, delay=0.0):
    store = _client(server)
    time.sleep(delay)
    results[uid] = agree_on_survivors(store, f"{JOB}gen1/", JOB, uid, members, DEAD_AFTER,
                                      time.monotonic() + 10)


def test_a_survivor_that_registers_late_is_waited_for_while_its_heartbeat_moves(server):
    members = [0, 1, 2]
    beats = [Heartbeat(_client(server), JOB, uid, interval=0.05) for uid in members]
    beats[2].stop()                       # replica 2 is lost: its counter stops now
    results = {}
    # Replica 1 registers 4 x dead_after late (it was still blocked in a collective):
    # alive all along, it must not be dropped.
    threads = [threading.Thread(target=_agree, args=(server, 0, members, results)),
               threading.Thread(target=_agree,
                                args=(server, 1, members, results, 4 * DEAD_AFTER))]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    for beat in beats[:2]:
        beat.stop()
    assert results == {0: [0, 1], 1: [0, 1]}
    assert time.monotonic() - started >= 4 * DEAD_AFTER


def test_agreement_begun_turns_true_with_the_first_registration_only_for_its_generation(
        server):
    # What a replica still blocked in a step reads (live recovery's step watch): once a
    # member registered for the next generation, that member abandoned the group.
    members = [0, 1]
    beats = [Heartbeat(_client(server), JOB, uid, interval=0.05) for uid in members]
    watcher = _client(server)
    assert not agreement_begun(watcher, f"{JOB}gen1/")
    results = {}
    thread = threading.Thread(target=_agree, args=(server, 0, members, results))
    thread.start()
    deadline = time.monotonic() + 10
    while not agreement_begun(watcher, f"{JOB}gen1/") and time.monotonic() < deadline:
        time.sleep(0.01)
    begun = agreement_begun(watcher, f"{JOB}gen1/")
    other_generation = agreement_begun(watcher, f"{JOB}gen2/")
    _agree(server, 1, members, results)
    thread.join(15)
    for beat in beats:
        beat.stop()
    assert begun and not other_generation
    assert results == {0: [0, 1], 1: [0, 1]}


def test_a_member_whose_heartbeat_stopped_is_lost_after_dead_after(server):
    members = [0, 1]
    beats = [Heartbeat(_client(server), JOB, uid, interval=0.05) for uid in members]
    beats[1].stop()
    results = {}
    started = time.monotonic()
    _agree(server, 0, members, results)
    beats[0].stop()
    assert results == {0: [0]}
    # Not counted as lost before its heartbeat had stood still for dead_after.
    assert time.monotonic() - started >= DEAD_AFTER


def test_a_member_that_never_registers_while_beating_ends_the_agreement_at_the_deadline(
        server):
    beat = Heartbeat(_client(server), JOB, 1, interval=0.05)
    store = _client(server)
    try:
        with pytest.raises(TimeoutError, match=r"replica\(s\) \[1\] neither rejoined"):
            agree_on_survivors(store, f"{JOB}gen1/", JOB, 0, [0, 1], DEAD_AFTER,
                               time.monotonic() + 2 * DEAD_AFTER + 0.5)
    finally:
        beat.stop()


def test_a_heartbeat_that_goes_unanswered_reports_the_store_unreachable():
    """The store's host frozen (SIGSTOP: it neither answers nor closes the connection, as
    a machine whose link went down): torch's client would wait for the reply until TCP
    gives up; the heartbeat's watch reports it after `unreachable_after` seconds."""
    server = subprocess.Popen([sys.executable, "-c", (
        "import datetime, sys, time, torch.distributed as dist\n"
        "s = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
        "print(s.port, flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=10))
        reported = []
        beat = Heartbeat(store, JOB, 0, interval=0.05, unreachable_after=1.0,
                         on_unreachable=reported.append)
        time.sleep(0.5)
        assert reported == [] and not beat.lost.is_set()    # answered while the host runs
        os.kill(server.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        while not reported and time.monotonic() - frozen < 10:
            time.sleep(0.05)
        assert beat.lost.is_set() and len(reported) == 1 and reported[0] >= 1.0
    finally:
        server.kill()
        server.wait()
