"""Admission under a backlog: newcomers join in batches (one prefill for several), while a
lone request is admitted as soon as a slot is free."""

import torch

from blockspec.config import EngineConfig
from blockspec.engine.kv_cache import SlotAllocator
from blockspec.engine.kv_cache_manager import KVCacheManager
from blockspec.engine.scheduler import Scheduler
from blockspec.engine.sequence import Sequence
from blockspec.sampling import SamplingParams


def sequences(n: int) -> list[Sequence]:
    return [Sequence(None, [1, 2, 3], SamplingParams(max_tokens=8), torch.Generator()) for _ in range(n)]


def scheduler(max_num_seqs: int) -> Scheduler:
    return Scheduler(
        EngineConfig(max_num_seqs=max_num_seqs),
        KVCacheManager((None,), [1000], 4, False),
        SlotAllocator(max_num_seqs + 1),
        lambda s: 1,
    )


def test_backlog_is_admitted_in_batches() -> None:
    sched = scheduler(16)
    for s in sequences(40):
        sched.add(s)
    assert len(sched.admit()) == 16
    sched.finish(sched.running[0], "stop")
    assert sched.admit() == []  # one free slot of 16, 23 waiting: wait for a batch of 2
    sched.finish(sched.running[0], "stop")
    assert len(sched.admit()) == 2 and len(sched.running) == 16


def test_lone_request_is_admitted_at_once() -> None:
    sched = scheduler(16)
    first, *rest = sequences(16)
    for s in rest:
        sched.add(s)
    sched.admit()
    sched.finish(sched.running[0], "stop")
    sched.add(first)
    assert sched.admit() == [first]
