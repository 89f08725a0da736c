"""An idle interpreter with a process kind's imports done, waiting to become a job process.

erld keeps a few per node (``daemon.pool``), each started as

    python -m elastic_rl.warm_interpreter elastic_rl.trainer.main

It lowers its CPU priority to the lowest (``elastic_rl.priority``), imports the
module it will run (and so everything that module imports: torch, megatron-core,
torchft, transformers; none of it initialises CUDA or opens a device, see ``main``), says so on its
stdout (a pipe erld reads; its stderr goes to the pool's log), then waits for
its assignment: one JSON line on stdin with the argv, environment, working
directory and log file of the process it is to become. It then runs at the
normal priority again, points its output at that log, takes that environment (CUDA reads CUDA_VISIBLE_DEVICES only
when first used, which is after this) and runs the module as ``__main__``, as
``python -m`` would. It runs in a session of its own from its start, so erld
signals its process group as any other job process's.

An interpreter whose erld dies before assigning it reads the end of stdin and
exits; a restarted erld also ends those still importing (``daemon.pool``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import runpy
import sys

import orjson

from elastic_rl.priority import lower_for_background, normal_priority

READY = "ready"
"""The line an interpreter writes once its imports are done."""

NVML_AVAILABILITY_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
"""Set while importing: torch.cuda.is_available() counts GPUs through NVML, without initialising CUDA."""


def become(assignment: dict) -> None:
    """Turn this interpreter into the assigned process and run it; returns when the process ends."""
    normal_priority(os.getpid())
    log = os.open(assignment["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(assignment["cwd"])
    os.environ.clear()
    os.environ.update(assignment["env"])
    module, *args = assignment["argv"]
    sys.argv = [module, *args]
    # Run afresh as __main__, as `python -m` does: its imports stay done, its own code runs once more.
    sys.modules.pop(module, None)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main() -> None:
    module = sys.argv[1]
    lower_for_background()  # before any thread starts: the threads the imports start take it too
    # Some imports ask torch whether CUDA is available (torch.utils.cpp_extension, under megatron-core).
    # By default that asks the CUDA driver, which reads CUDA_VISIBLE_DEVICES then, once per process: with
    # the pool's "" it would find no GPU, and the process this interpreter becomes would never see its own.
    # Asked through NVML instead, the driver stays untouched until the assigned process first uses CUDA.
    os.environ[NVML_AVAILABILITY_CHECK] = "1"
    importlib.import_module(module)
    # Its stdout is a pipe erld reads: the imports are done. Already taken, it has no reader any more.
    with contextlib.suppress(BrokenPipeError):
        os.write(1, f"{READY}\n".encode())
    line = sys.stdin.buffer.readline()
    if not line:
        return  # erld went away before it needed this interpreter
    become(orjson.loads(line))


if __name__ == "__main__":
    main()
