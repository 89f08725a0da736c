"""Where a job runs: the node with the most free device slots that fits the job.

Pure: free slots per node in, a node (or the reason none fits) out. Ties go to
the node name that sorts first, so placement is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    node: str | None
    reason: str = ""


def place_job(devices_needed: int, free_devices: dict[str, list[int]]) -> Placement:
    fitting = [(len(free), node) for node, free in free_devices.items() if len(free) >= devices_needed]
    if not fitting:
        most = max((len(free) for free in free_devices.values()), default=0)
        return Placement(
            None,
            f"needs {devices_needed} device slots; the largest free set on a node is {most} "
            f"(start erld with more --cpu-devices, or free devices)",
        )
    _, node = min(fitting, key=lambda item: (-item[0], item[1]))
    return Placement(node)
