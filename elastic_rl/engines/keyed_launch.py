"""SGLang and sglang-router started with the job's secret, which they take only as a flag, off the command line.

    python -m elastic_rl.engines.keyed_launch sglang.launch_server --model-path ... --port 30001

reads the secret from its environment (``elastic_rl.job_secret``), adds the
flags that give it to the module named, and runs that module in this process
as ``python -m`` would. The process's command line, which any user of the
node can read in ``/proc``, stays the one above. SGLang's scheduler and
detokenizer are started by multiprocessing, with no arguments on theirs;
sglang-router runs its server in this process.

SGLang asks the secret on everything but ``/health*`` and ``/metrics``.
sglang-router asks it on its worker API (its control-plane key, admin role)
and its generation API (``--api-key``); it sends each engine the key the
engine was registered with (``RouterClient.add_worker``). Without a secret
in the environment the module runs as given.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable

from elastic_rl import job_secret

# ``--flag=value``: a value that starts with "-" is still the flag's, not an option of its own.
SECRET_FLAGS: dict[str, Callable[[str], list[str]]] = {
    "sglang.launch_server": lambda secret: [f"--api-key={secret}"],
    "sglang_router.launch_router": lambda secret: [
        f"--api-key={secret}",
        f"--control-plane-api-keys=erld:elastic-rl:admin:{secret}",
    ],
}


def keyed_argv(module: str, args: list[str], secret: str | None) -> list[str]:
    """The argv ``module`` runs with: ``args`` and, given a secret, the flags that carry it."""
    return [module, *args, *(SECRET_FLAGS[module](secret) if secret else [])]


def main() -> None:
    module, *args = sys.argv[1:]
    if module not in SECRET_FLAGS:
        sys.exit(f"keyed_launch runs {', '.join(SECRET_FLAGS)}, not {module}")
    sys.argv = keyed_argv(module, args, job_secret.from_environment())
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
