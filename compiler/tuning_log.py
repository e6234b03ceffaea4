"""A target's tuning log, `tuning_logs/<target>/`: MetaSchedule's JSON database (every measured trial, one line
each, appended as it comes) and `mobilec-tuned.json` (per kernel: the record `mobilec tune` picked and its latency
next to our default rules', as last measured). Compile applies a record only where it beat the default."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import tvm
from tvm.s_tir import meta_schedule as ms

from .data_files import data_dir
from .errors import MobilecError

TUNING_LOGS_DIR = data_dir("tuning_logs")
TUNING_LOGS_ENV = "MOBILEC_TUNING_LOGS"  # another root for tuning_logs/ (tests, experiments)
WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
SELECTION_FILE = "mobilec-tuned.json"
SELECTION_FIELDS = {"record", "default_us", "tuned_us"}
FAILED_RUN_S = 1e9  # MetaSchedule records a trial that failed to build or run as 1e10 s


def log_dir(target_name: str) -> Path:
    return Path(os.environ.get(TUNING_LOGS_ENV) or TUNING_LOGS_DIR) / target_name


def normalized(func: tvm.tirx.PrimFunc) -> tvm.IRModule:
    """The kernel as MetaSchedule's database holds it (the normalization its apply pass uses too)."""
    return tvm.get_global_func("tvm.s_tir.meta_schedule.normalize_mod")(func)


def workload_key(func: tvm.tirx.PrimFunc) -> str:
    """The structural hash the database files a kernel under."""
    return ms.database.Workload(normalized(func)).as_json()[0]


@dataclasses.dataclass
class Record:
    workload: str  # workload key
    json: list  # the record as the file has it: [trace, run seconds, target, argument info]

    @property
    def key(self) -> str:
        """Names the record's schedule (its trace), so mobilec-tuned.json can point at exactly one record."""
        return hashlib.sha256(json.dumps(self.json[0], sort_keys=True).encode()).hexdigest()[:16]

    @property
    def mean_us(self) -> float | None:
        """Mean measured latency; None for a trial that failed to build or run."""
        secs = self.json[1]
        if not secs or max(secs) >= FAILED_RUN_S:
            return None
        return sum(secs) / len(secs) * 1e6


@dataclasses.dataclass
class TuningLog:
    workloads: dict[str, list]  # key -> the workload's line ([key, serialized module])
    records: list[Record]

    def records_for(self, key: str) -> list[Record]:
        return [r for r in self.records if r.workload == key]

    def best(self, key: str) -> Record | None:
        measured = [r for r in self.records_for(key) if r.mean_us is not None]
        return min(measured, key=lambda r: r.mean_us) if measured else None

    def schedule(self, record: Record) -> tvm.IRModule:
        """The workload with the record's schedule applied."""
        workload = ms.database.Workload.from_json(self.workloads[record.workload])
        sch = tvm.s_tir.Schedule(workload.mod)
        ms.database.TuningRecord.from_json(record.json, workload).trace.apply_to_schedule(sch, remove_postproc=False)
        return sch.mod


def _corrupt(path: Path, where: str, fix: str) -> MobilecError:
    return MobilecError(f"tuning database {path} is corrupt ({where}); {fix}")


def _lines(path: Path, fix: str) -> list[Any]:
    """The JSON lines of one database file; a last line cut short by a killed run is left out (repair() drops it)."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    parsed = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise _corrupt(path, f"line {number}: {err.msg}", fix) from None
    return parsed


def read_log(directory: Path, fix: str) -> TuningLog:
    """Both database files, checked line by line; `fix` ends the one-line error a corrupt file gives."""
    workload_path, record_path = directory / WORKLOAD_FILE, directory / RECORD_FILE
    workload_lines = _lines(workload_path, fix)
    if not all(isinstance(w, list) and len(w) == 2 and all(isinstance(x, str) for x in w) for w in workload_lines):
        raise _corrupt(workload_path, "a line is not [hash, module]", fix)
    records = []
    for number, line in enumerate(_lines(record_path, fix), 1):
        if not (isinstance(line, list) and len(line) == 2 and isinstance(line[0], int)
                and 0 <= line[0] < len(workload_lines) and isinstance(line[1], list) and len(line[1]) == 4):
            raise _corrupt(record_path, f"record {number} is not [workload index, record]", fix)
        records.append(Record(workload_lines[line[0]][0], line[1]))
    return TuningLog({w[0]: w for w in workload_lines}, records)


def repair(directory: Path) -> list[str]:
    """End both files with a complete line before MetaSchedule appends to them: a run killed mid-write can leave
    a line cut short (dropped) or one without its newline (completed). Returns what was done, for the user."""
    notes = []
    for path in (directory / WORKLOAD_FILE, directory / RECORD_FILE):
        if not path.is_file() or path.stat().st_size == 0:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.endswith("\n"):
            continue
        head, _, last = text.rpartition("\n")
        try:
            json.loads(last)
            path.write_text(text + "\n", encoding="utf-8")
            notes.append(f"{path}: ended its last line")
        except json.JSONDecodeError:
            path.write_text(head + "\n" if head else "", encoding="utf-8")
            notes.append(f"{path}: dropped a last line cut short by an interrupted run")
    return notes


def read_selection(directory: Path, fix: str) -> dict[str, dict[str, Any]]:
    """mobilec-tuned.json: workload key -> kernel names, record key, default and tuned latency (us), trials."""
    path = directory / SELECTION_FILE
    if not path.is_file():
        return {}
    try:
        selection = dict(json.loads(path.read_text(encoding="utf-8"))["kernels"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise _corrupt(path, f"{type(err).__name__}: {err}", fix) from None
    for key, entry in selection.items():
        if not isinstance(entry, dict) or not SELECTION_FIELDS <= entry.keys():
            raise _corrupt(path, f"kernel {key} lacks one of {', '.join(sorted(SELECTION_FIELDS))}", fix)
    return selection


def write_selection(directory: Path, selection: dict[str, dict[str, Any]]) -> None:
    path = directory / SELECTION_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"kernels": selection}, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def beats_default(entry: dict[str, Any]) -> bool:
    return entry["tuned_us"] is not None and entry["default_us"] is not None and entry["tuned_us"] < entry["default_us"]


def applied_records(directory: Path, fix: str) -> tuple[ms.database.MemoryDatabase, dict[str, str]]:
    """What compile applies: a database holding the records mobilec-tuned.json picked that measured faster than
    our default rules, and workload key -> record key for each."""
    selection = read_selection(directory, fix)
    wanted = {key: entry["record"] for key, entry in selection.items() if beats_default(entry)}
    database = ms.database.MemoryDatabase()
    if not wanted:
        return database, {}
    log = read_log(directory, fix)
    applied = {}
    for record in log.records:
        if wanted.get(record.workload) == record.key and record.workload not in applied:
            workload = database.commit_workload(ms.database.Workload.from_json(log.workloads[record.workload]).mod)
            database.commit_tuning_record(ms.database.TuningRecord.from_json(record.json, workload))
            applied[record.workload] = record.key
    return database, applied
