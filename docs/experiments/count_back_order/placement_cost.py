"""What a placement spends on its decode workers' free blocks and batch places (`Predictor.free_blocks`,
`has_batch_room`) with 8 decode workers of 128 streams each, of which 0, 16 or 64 on each worker ended since its last
report (half of those before it on the worker), and the free blocks it estimates for one of them. Run against a tree
with `PYTHONPATH=<tree>/src:<tree>`; `run.sh` runs the trees before and after the freed-sequences count, alternated. A
tree without the count ends its streams without saying when their worker freed them."""

from __future__ import annotations

import dataclasses
import inspect
import statistics
import sys
import time

from pdserve.config import RouterConfig
from pdserve.registry.base import WorkerState
from services.router.load_tracker import LoadTracker
from services.router.predictor import Predictor

WORKERS, STREAMS = 8, 128
REPS, ROUNDS = 2000, 7
SAYS_FREED = "freed" in inspect.signature(LoadTracker.finished).parameters


def report(worker: int, freed: int) -> WorkerState:
    fields = dict(
        worker_id=f"decode-{worker}",
        role="decode",
        address=f"decode-{worker}:1",
        kv_blocks_total=8192,
        kv_blocks_free=8192 - STREAMS * 41,
        max_num_seqs=2 * STREAMS,
        sequences=STREAMS,
        running=STREAMS,
        instance=f"process-{worker}",
        load_age_s=0.0,
        sequences_freed=freed,
    )
    known = {f.name for f in dataclasses.fields(WorkerState)}
    return WorkerState(**{k: v for k, v in fields.items() if k in known})  # type: ignore[arg-type]


def fleet(ended: int) -> tuple[Predictor, list[WorkerState]]:
    tracker = LoadTracker()
    reports = []
    for worker in range(WORKERS):
        placements = []
        for stream in range(STREAMS):
            placed = tracker.start("prefill-0", f"decode-{worker}", 100, 0.05, 64, 600, 38)
            tracker.prefilled(placed)
            tracker.streamed(placed, 38 + stream % 3)
            placements.append(placed)
        time.sleep(0.001)
        reports.append(report(worker, freed=100 + ended // 2))
        time.sleep(0.001)
        for n, placed in enumerate(placements[:ended]):
            if SAYS_FREED:
                from services.router.worker_frees import FreedAt

                tracker.finished(placed, FreedAt(f"process-{worker}", 100 + n + 1))
            else:
                tracker.finished(placed)
    return Predictor(RouterConfig(), tracker), reports


def measure(ended: int, label: str) -> None:
    predictor, reports = fleet(ended)
    per_placement_us = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(REPS):
            for w in reports:
                predictor.free_blocks(w)
                predictor.has_batch_room(w)
        per_placement_us.append((time.perf_counter() - start) / REPS * 1e6)
    free = [predictor.free_blocks(w) for w in reports]
    print(
        f"{label}, {ended:2d} ended a worker: {statistics.median(per_placement_us):6.1f} us a placement (median of "
        f"{ROUNDS} rounds, min {min(per_placement_us):.1f}); {free[0]} free estimated, {reports[0].kv_blocks_free} "
        "reported"
    )


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else ("after" if SAYS_FREED else "before")
    for ended in (0, 16, 64):
        measure(ended, label)


if __name__ == "__main__":
    main()
