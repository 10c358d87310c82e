"""Keys that spread the reward flow's Kafka partitions evenly over the workers of a Bytewax cluster.

The reward flow keeps one event-time clock per Kafka partition: its stateful step is keyed by partition. Bytewax
sends each key to one worker by a hash of the key modulo the number of workers, so the plain keys ``"0"``..``"3"``
may all land on one worker: with 4 partitions on 2 workers they do (``"0"``-``"3"`` all go to worker 1), and the
other worker reads its share of the topic, hands every event over, and computes no reward. :func:`balanced_keys`
gives each partition a key that lands on a worker with room, at most ``ceil(partitions / workers)`` a worker,
keeping the plain key wherever it already fits (so state snapshotted under it resumes) and otherwise trying
``"<p>~1"``, ``"<p>~2"``, ...

Where a key lands is asked of Bytewax itself (:func:`workers_of`): a throwaway dataflow with that many worker
threads in this process, its keyed step feeding a sink that records each worker's index. The routing depends only
on the key and the total number of workers (``processes x workers per process``: every worker of the cluster has
one global index), so every process of a cluster computes the same keys; a change of Bytewax's hash changes the
answer, not its correctness.
"""

from __future__ import annotations

import functools
import math
import threading

#: candidate keys tried per partition beyond the plain one: 8 per worker keeps the chance that none of them lands
#: on the last worker with room below e^-8 (each lands there with probability 1/workers)
TRIES_PER_WORKER = 8


@functools.lru_cache(maxsize=16)
def workers_of(keys: tuple[str, ...], workers: int) -> dict[str, int]:
    """The worker index each key of a keyed Bytewax step goes to, with ``workers`` workers in all."""
    import bytewax.operators as op
    from bytewax.dataflow import Dataflow
    from bytewax.outputs import DynamicSink, StatelessSinkPartition
    from bytewax.run import cli_main
    from bytewax.testing import TestingSource

    seen: dict[str, int] = {}
    lock = threading.Lock()

    class Part(StatelessSinkPartition):
        def __init__(self, index: int):
            self.index = index

        def write_batch(self, items: list[str]) -> None:
            with lock:
                seen.update((k, self.index) for k in items)

    class Where(DynamicSink):
        def build(self, step_id: str, worker_index: int, worker_count: int) -> Part:
            return Part(worker_index)  # after a stateful step, items stay on the worker that holds their key

    flow = Dataflow("rtrl_key_routing")
    keyed = op.key_on("key", op.input("keys", flow, TestingSource(list(keys))), lambda k: k)
    held = op.stateful_map("hold", keyed, lambda state, k: (None, k))
    op.output("where", op.map("key_of", held, lambda kv: kv[0]), Where())
    cli_main(flow, workers_per_process=workers)
    missing = set(keys) - seen.keys()
    if missing:
        raise RuntimeError(f"Bytewax placed no worker for keys {sorted(missing)[:5]}")
    return seen


def balanced_keys(partitions: int, workers: int) -> dict[int, str]:
    """Partition -> the key its events are windowed under, at most ``ceil(partitions / workers)`` partitions a
    worker; the plain ``str(partition)`` wherever it fits. One worker: the plain keys, without asking Bytewax."""
    plain = {p: str(p) for p in range(partitions)}
    if workers <= 1 or partitions <= 1:
        return plain
    tries = TRIES_PER_WORKER * workers + 32
    candidates = {p: [str(p)] + [f"{p}~{n}" for n in range(1, tries + 1)] for p in range(partitions)}
    where = workers_of(tuple(k for ks in candidates.values() for k in ks), workers)
    cap, load, out = math.ceil(partitions / workers), [0] * workers, {}
    for p in range(partitions):
        key = next((k for k in candidates[p] if load[where[k]] < cap), None)
        if key is None:
            raise RuntimeError(f"no key of partition {p} among {tries + 1} lands on a worker with room")
        out[p] = key
        load[where[key]] += 1
    return out
