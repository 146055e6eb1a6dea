"""Readers of what the optional sinks leave on disk, for the tests: TensorBoard event files
(TFRecord framing parsed here, every CRC checked) and the W&B offline datastore
(run-<id>.wandb: LevelDB-log framing of wandb_internal_pb2.Record; wandb 0.31 has no
reader and writes no files/wandb-summary.json offline)."""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from pathlib import Path
from typing import Any


def tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} over every event file in the order TensorBoard reads them, as it
    shows them: a SessionLog START at step s (a writer's purge_step) hides what earlier files
    hold at steps >= s; a step written twice and not purged (TensorBoard would plot both) fails."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    out: dict[str, dict[int, float]] = defaultdict(dict)
    files = sorted(logdir.glob("events.out.tfevents.*"))  # by name, as TensorBoard reads them
    assert files, f"no event files in {logdir}"
    for f in files:
        data, pos = f.read_bytes(), 0
        while pos < len(data):
            header = data[pos : pos + 8]
            (n,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked_crc32c(header), f"{f}: length crc"
            body = data[pos + 12 : pos + 12 + n]
            assert struct.unpack("<I", data[pos + 12 + n : pos + 16 + n])[0] == masked_crc32c(body), f"{f}: data crc"
            pos += 16 + n
            event = event_pb2.Event()
            event.ParseFromString(body)
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                for series in out.values():
                    for s in [s for s in series if s >= event.step]:
                        del series[s]
            for v in event.summary.value:
                assert event.step not in out[v.tag], f"{v.tag}: step {event.step} twice"
                out[v.tag][event.step] = v.simple_value
    return dict(out)


def wandb_records(run_file: Path) -> list[Any]:
    """The records of a W&B datastore: 7-byte file header (":W&B", magic, version), then
    LevelDB log records in 32 KiB blocks (crc32c u32, length u16, type u8: 1 full, 2 first,
    3 middle, 4 last; a block tail under 7 bytes is padding)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (2, 3):  # first, middle: more to come
            pending += chunk
            continue
        if kind == 4:
            chunk, pending = pending + chunk, b""
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
    return records


def wandb_history(records: list[Any]) -> dict[int, dict[str, Any]]:
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            rows[r.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
    return rows


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))
