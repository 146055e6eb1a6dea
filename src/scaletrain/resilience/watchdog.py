"""Hang watchdog: name the stuck ranks and the collective they disagree on, before the
collective timeout does it with a bare stack trace.

Each rank runs a daemon thread that sees the loop's heartbeat (a float set per step: no
collective, no store traffic). When a rank's loop has not moved for `timeout_s`, its thread
writes what this rank knows into <run>/hang: the Python stacks of every thread
(rank<k>.txt) and the flight recorder's collectives (fr_rank<k>.json; TORCH_FR_BUFFER_SIZE
is set before the process group, launch/distributed.py). It publishes a summary on the process
group's key-value store, which keeps working while the collectives are stuck. A rank stuck
outside any collective (the cause) and the ranks waiting in one for it (the victims) all
stop beating, the cause first; rank 0's thread waits a little for every summary, tells
them apart by the flight recorder (the victims hold an unfinished collective whose
sequence number the cause never reached), writes hang.json, prints one line, and every
rank exits with EXIT_HUNG. Under `launch --max-restarts` torchrun then restarts the group,
which resumes from its newest checkpoint.

The thread needs the GIL: a rank wedged inside a C call that holds it cannot report; rank 0
then names it as the rank whose summary never came.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.errors import EXIT_HUNG
from scaletrain.launch.distributed import World

_KEY = "scaletrain/hang/{}"
_DONE = "scaletrain/hang/read"
_BYE = "scaletrain/hang/bye/{}"


def flight_record() -> list[dict[str, Any]]:
    """This rank's recorded collectives (oldest first): seq, name, group, retired."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)  # private, torch 2.13
    try:
        raw = dump(includeCollectives=True, onlyActive=False) if dump else b"{}"
    except Exception:  # no recorder in this build or backend: the stacks still tell a lot
        return []
    entries = json.loads(raw).get("entries", [])
    return [
        {
            "seq": e.get("collective_seq_id"),
            "name": e.get("profiling_name"),
            "process_group": e.get("process_group"),
            "retired": e.get("retired"),
            "input_sizes": e.get("input_sizes"),
        }
        for e in entries
    ]


def stuck_collectives(summaries: dict[int, dict[str, Any] | None]) -> dict[str, Any]:
    """From every rank's summary (None: never came), the stuck ranks and the collective the
    others wait in. Per process group: a rank that has not reached the highest sequence
    number anyone entered is stuck; the unfinished collective there is what they disagree on."""
    stuck: set[int] = {r for r, s in summaries.items() if s is None}
    collective: dict[str, Any] | None = None
    groups: dict[str, dict[int, int]] = {}
    for rank, s in summaries.items():
        for e in (s or {}).get("collectives", []):
            if e["seq"] is not None:
                seqs = groups.setdefault(str(e["process_group"]), {})
                seqs[rank] = max(seqs.get(rank, 0), e["seq"])
    for group, seqs in groups.items():
        top = max(seqs.values())
        behind = [r for r in summaries if summaries[r] is not None and seqs.get(r, 0) < top]
        if not behind:
            continue
        stuck.update(behind)
        waiting = [r for r, seq in seqs.items() if seq == top]
        entry = next(e for e in summaries[waiting[0]]["collectives"] if e["seq"] == top and str(e["process_group"]) == group)  # type: ignore[index]
        collective = {
            "seq": top,
            "name": entry["name"],
            "process_group": group,
            "waiting_ranks": waiting,
            "missing_ranks": behind,
        }
    if not stuck and summaries:
        # No collective tells them apart (e.g. all idle): the rank that stopped beating first.
        oldest = min((s["idle_s"], r) for r, s in summaries.items() if s is not None)
        stuck.add(oldest[1]) if oldest[0] > 0 else None
    return {"stuck_ranks": sorted(stuck), "collective": collective}


class Watchdog:
    def __init__(self, world: World, run_dir: Path, timeout_s: float, say: Any):
        self.world = world
        self.dir = run_dir / "hang"
        self.timeout_s = timeout_s
        self.say = say
        self.step = 0
        self._beat = time.monotonic()
        self._paused = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if timeout_s > 0:
            self._store = dist.distributed_c10d._get_default_store() if world.distributed else None
            self._thread = threading.Thread(target=self._watch, name="scaletrain-watchdog", daemon=True)
            self._thread.start()

    def beat(self, step: int | None = None) -> None:
        """The loop moved (once per step, and around long operations such as a save)."""
        if step is not None:
            self.step = step
        self._beat = time.monotonic()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Around work whose length has nothing to do with a hang (a save waiting for the disk,
        a rollback's load): not watched; it has its own collectives' timeout."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            self.beat()

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 10)):
            idle = time.monotonic() - self._beat
            if idle >= self.timeout_s and not self._paused:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        rank = self.world.rank
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / f"rank{rank}.txt", "w") as f:
            f.write(f"rank {rank}, last completed step {self.step}, no progress for {idle:.0f} s\n\n")
            faulthandler.dump_traceback(file=f, all_threads=True)
        collectives = flight_record()
        (self.dir / f"fr_rank{rank}.json").write_text(json.dumps(collectives, indent=1))
        summary = {"rank": rank, "step": self.step, "idle_s": idle, "collectives": collectives[-20:]}
        summaries: dict[int, dict[str, Any] | None] = {rank: summary}
        if self._store is not None:
            self._store.set(_KEY.format(rank), json.dumps(summary))
            if self.world.is_main:
                summaries = self._collect(summary)
        if self.world.is_main:
            verdict = stuck_collectives(summaries)
            report = {
                "step": [s["step"] if s else None for _, s in sorted(summaries.items())],
                **verdict,
                "timeout_s": self.timeout_s,
            }
            (self.dir / "hang.json").write_text(json.dumps(report, indent=1) + "\n")
            what = verdict["collective"]
            on = (
                f"; rank(s) {what['waiting_ranks']} wait in {what['name']} (seq {what['seq']}), which rank(s) "
                f"{what['missing_ranks']} never entered"
                if what
                else ""
            )
            self.say(
                f"scaletrain: error: hang: rank(s) {verdict['stuck_ranks']} made no progress for {self.timeout_s:g} s "
                f"(guards.hang_timeout_s){on}; stacks and collectives in {self.dir}"
            )
            # Only now may the others go: the agent stops every rank once one has exited,
            # and this one must have written and said everything first.
            if self._store is not None:
                self._store.set(_DONE, "1")
            self._wait_for_byes(summaries)
        elif self._store is not None:
            # Until rank 0 has reported: an early exit would have the agent stop rank 0
            # mid-report. Capped, in case rank 0 itself cannot report.
            deadline = time.monotonic() + min(self.timeout_s, 30.0) + 5.0
            with contextlib.suppress(Exception):  # the store went with rank 0: it is done
                while not self._store.check([_DONE]) and time.monotonic() < deadline:
                    time.sleep(0.2)
                self._store.set(_BYE.format(rank), "1")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_HUNG)

    def _wait_for_byes(self, summaries: dict[int, dict[str, Any] | None]) -> None:
        """The store lives in rank 0's process: leaving before the others saw DONE would
        turn their last look at it into a connection error."""
        if self._store is None:
            return
        keys = [_BYE.format(r) for r, s in summaries.items() if s is not None and r != self.world.rank]
        deadline = time.monotonic() + 3.0
        while keys and not self._store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _collect(self, mine: dict[str, Any]) -> dict[int, dict[str, Any] | None]:
        """Every rank's summary, waiting up to the timeout for those not yet written (the
        victims fire later than the cause: they stopped beating when they entered the
        collective the cause never reached)."""
        assert self._store is not None
        out: dict[int, dict[str, Any] | None] = {}
        deadline = time.monotonic() + min(self.timeout_s, 30.0)
        for r in range(self.world.world_size):
            if r == self.world.rank:
                out[r] = mine
                continue
            key = _KEY.format(r)
            while not self._store.check([key]) and time.monotonic() < deadline:
                time.sleep(0.2)
            out[r] = json.loads(self._store.get(key)) if self._store.check([key]) else None
        return out
