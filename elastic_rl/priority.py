"""The CPU priority of erld's pre-imported interpreters: they import at the lowest, so that a pool
refilled in the middle of a run uses only the CPU the job's processes leave, and the process an
interpreter becomes runs at the normal one.

Two niceness values decide a process's share. A thread's own (a new thread takes its creator's):
an interpreter lowers its own before its imports start any thread, and raising sets every
thread. And, where the kernel schedules by autogroup (``/proc/sys/kernel/sched_autogroup_enabled``,
for processes outside a CPU cgroup of their own), its session's: each session shares the CPU as
one group, whatever its threads' niceness, so an interpreter (a session of its own) lowers that
too. Raising needs CAP_SYS_NICE or a RLIMIT_NICE that allows it; without either an interpreter
never lowers itself.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

BACKGROUND_NICE = 19
CAP_SYS_NICE = 23  # the capability's bit in /proc/<pid>/status's CapEff


def can_raise_priority() -> bool:
    """Whether this process may set a niceness back to 0: CAP_SYS_NICE, or an RLIMIT_NICE of at least
    20 (the limit counts nice 0 as 20)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or soft >= 20:
        return True
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    return False


def lower_for_background() -> None:
    """This process (its one thread, every thread it starts, and its session) to the lowest priority,
    if it may raise it again."""
    if can_raise_priority():
        os.nice(BACKGROUND_NICE)
        _set_session_nice(os.getpid(), BACKGROUND_NICE)


def normal_priority(pid: int) -> None:
    """Every thread of ``pid``, and its session, to nice 0; the threads are looked at again in case a
    lowered one started another."""
    try:
        _set_session_nice(pid, 0)
        for _ in range(5):
            tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
            lowered = [tid for tid in tids if os.getpriority(os.PRIO_PROCESS, tid)]
            for tid in lowered:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
            if not lowered:
                return
    except (FileNotFoundError, ProcessLookupError):
        return  # it, or one of its threads, exited
    except PermissionError:
        return  # no right to raise it, and so the interpreter never lowered itself


def _set_session_nice(pid: int, nice: int) -> None:
    """The niceness of ``pid``'s autogroup, where the kernel has autogroups."""
    autogroup = Path(f"/proc/{pid}/autogroup")
    if autogroup.exists():
        autogroup.write_text(str(nice))
