"""A trainer process's own record of the exit code it ends with.

erld learns a child's exit code from ``wait``. A process it adopted from an
earlier erld is not its child, so that code is lost, and an unknown exit must
count as a crash. That makes a trainer that finished its work at the job's end
look like one that died, and a warm spare would be promoted for it. So a trainer
writes the code it ends with before it ends, keyed by its pid and start time (a
reused pid does not match), and erld reads it when ``wait`` cannot tell.
A process killed by a signal writes nothing: its exit stays unknown, a crash.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import psutil

from checkpoints import layout
from elastic_rl.atomic import write_file_atomic


def write(workdir: Path, exit_code: int) -> None:
    """Record that this process is about to end with ``exit_code``."""
    me = psutil.Process()
    record = {"create_time": me.create_time(), "exit_code": exit_code}
    write_file_atomic(layout.exit_record_path(workdir, me.pid), orjson.dumps(record))


def read(workdir: Path, pid: int, create_time: float | None) -> int | None:
    """The exit code the process ``pid`` started at ``create_time`` recorded; None if it recorded none."""
    path = layout.exit_record_path(workdir, pid)
    try:
        record = orjson.loads(path.read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return None
    if record.get("create_time") != create_time:
        return None  # another process that had the same pid
    return record.get("exit_code")
