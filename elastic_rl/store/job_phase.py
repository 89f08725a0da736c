"""The phase of a job, as its status record in etcd holds it.

Stored as the member's string value, which never changes: every erld of a cluster, whatever version it
runs, reads the same record.

pending -> running -> succeeded | failed; `erl stop`: stopping -> stopped (a job not running stops at
once); a job below its minimum for longer than its grace: pausing -> paused, then pending again when
room returns; `erl resume` takes a stopped, failed or paused job back to pending.
"""

from __future__ import annotations

from enum import StrEnum


class JobPhase(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    STOPPING = "stopping"
    PAUSING = "pausing"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


TERMINAL_PHASES = (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED)
"""The job is over: nothing of it runs, and only `erl resume` (not stopped by success) starts it again."""
ACTIVE_PHASES = (JobPhase.RUNNING, JobPhase.STOPPING, JobPhase.PAUSING)
"""The job's processes hold their device slots."""
RESUMABLE_PHASES = (JobPhase.STOPPED, JobPhase.FAILED, JobPhase.PAUSED)
"""`erl resume` takes the job back to pending."""
LEAVING_PHASES = (JobPhase.STOPPING, JobPhase.PAUSING)
"""The job's processes are being stopped gracefully."""
