"""The orchestrator process: draws prompts, generates through the router, scores, commits rollouts.

    started by erld as: python -m elastic_rl.rollout.orchestrator   (ERL_* variables from jobenv)

For each rollout it makes sure the engines serve the weight version the mode
prescribes (sync: version N for rollout N; async: version N - 1, so rollout
N + 1 generates while N trains), draws and renders the prompts (through the
chat template when the spec asks; a prompt over ``rollout.max_prompt_len``
tokens is skipped, recorded and replaced by the next one), generates
``n_samples_per_prompt`` responses per prompt, scores them, and commits the
batch with the data source's state to ``rollouts/<N>``. It writes one metrics line per trained rollout to
``metrics.jsonl`` and the job's progress to etcd, and exits 0 once the last
rollout is trained.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import orjson
import torch

from elastic_rl import jobenv
from elastic_rl.algo.choices import AlgorithmKind
from elastic_rl.atomic import write_file_atomic
from elastic_rl.config import JobSpec
from elastic_rl.engines.client import EngineClient
from elastic_rl.engines.router import RouterClient
from elastic_rl.errors import ElasticRLError
from elastic_rl.fencing import Assignment
from elastic_rl.model.tokenizer import load_tokenizer, pad_token_id
from elastic_rl.rollout.batch import RolloutBatch, read_rollout, write_rollout
from elastic_rl.rollout.data import DataSource, Prompt
from elastic_rl.rollout.metric_sinks import metric_sinks
from elastic_rl.rollout.progress import ProgressReporter
from elastic_rl.rollout.prompts import render, render_response
from elastic_rl.rollout.rewards import load_reward

log = logging.getLogger("elastic_rl.orchestrator")

POLL_INTERVAL_S = 0.05
RETRY_ENGINES_S = 1.0
# With the client's backoff (up to 2 s a try) this rides out about half a minute without engines.
ROUTER_ATTEMPTS = 16


def generating_version(rollout_id: int, mode: str) -> int:
    """The weight version that generates a rollout: a function of its id and the mode only."""
    return rollout_id if mode == "sync" else max(0, rollout_id - 1)


def sample_seed(job_seed: int, rollout_id: int, sample_index: int) -> int:
    digest = hashlib.sha256(f"{job_seed}/{rollout_id}/{sample_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class Orchestrator:
    def __init__(
        self, env: jobenv.JobEnv, router: RouterClient, progress: ProgressReporter, assignment: Assignment | None
    ):
        self.spec: JobSpec = env.spec
        self.workdir = env.workdir
        self.router = router
        self.progress = progress
        self.tokenizer = load_tokenizer(self.spec.model)
        self.reward = load_reward(self.spec.rollout.reward)
        self.data = DataSource(self.spec.data, self.spec.seed)
        self.sinks = metric_sinks(self.spec, self.workdir)
        # Checked before each commit: only the orchestrator the controller assigned writes the log.
        self.assignment = assignment
        self.engine_version: int | None = None
        self.commit_times: dict[int, float] = {}

    # --- weights --------------------------------------------------------------

    async def wait_for_weights(self, version: int) -> Path:
        folder = jobenv.weights_dir(self.workdir, version)
        while not folder.is_dir():
            await asyncio.sleep(POLL_INTERVAL_S)
        return folder

    async def wait_for_engines(self) -> None:
        """The router may have no engine yet (they start on other nodes, or are being replaced)."""
        while not await self.router.worker_urls():
            await asyncio.sleep(POLL_INTERVAL_S)

    async def serve_version(self, version: int) -> float:
        """Load weights ``version`` into every engine behind the router; return the seconds the load took.

        An engine that cannot take them is dead or dying: once erld has taken it out of the router it
        is no longer waited for (its replacement loads the newest weights before it serves).
        """
        if self.engine_version == version:
            return 0.0
        folder = await self.wait_for_weights(version)
        started = time.monotonic()
        pending = set(await self.router.worker_urls())
        while pending:
            loads = await asyncio.gather(
                *(EngineClient(url).update_weights_from_disk(str(folder), str(version)) for url in sorted(pending)),
                return_exceptions=True,
            )
            for url, outcome in zip(sorted(pending), loads):
                if not isinstance(outcome, Exception):
                    pending.discard(url)
                else:
                    log.warning("engine %s did not load weights %d: %s", url, version, outcome)
            if pending:
                await asyncio.sleep(RETRY_ENGINES_S)
                pending &= await self.router.worker_urls()
        self.engine_version = version
        return time.monotonic() - started

    # --- generation -------------------------------------------------------------

    def draw(self) -> tuple[list[tuple[Prompt, list[int], list[int]]], list[Prompt]]:
        """The rollout's prompts with their ids and, for SFT, their responses' ids (else empty);
        and the over-long ones skipped on the way.

        A skipped prompt counts as drawn (it is never drawn again); the next prompt takes its place.
        For SFT a response longer than rollout.max_new_tokens is skipped like an over-long prompt.
        """
        rollout, limit = self.spec.rollout, self.spec.prompt_limit
        wanted = rollout.prompts_per_rollout
        supervised = self.spec.algorithm.kind is AlgorithmKind.SFT
        kept: list[tuple[Prompt, list[int], list[int]]] = []
        skipped: list[Prompt] = []
        while len(kept) < wanted:
            if len(skipped) >= len(self.data.records):
                raise ElasticRLError(f"no prompt of the data fits rollout.max_prompt_len ({limit} tokens)")
            for prompt in self.data.draw(wanted - len(kept)):
                ids = render(self.tokenizer, self.spec.data, prompt.text)
                response = []
                if supervised:
                    response = render_response(self.tokenizer, self.spec.data, prompt.text, prompt.label)
                if len(ids) > limit or len(response) > rollout.max_new_tokens:
                    skipped.append(prompt)
                else:
                    kept.append((prompt, ids, response))
        return kept, skipped

    def sampling_params(self, rollout_id: int, index: int) -> dict[str, Any]:
        spec = self.spec.rollout
        params: dict[str, Any] = {
            "temperature": spec.temperature,
            "top_p": spec.top_p,
            "top_k": spec.top_k,
            "max_new_tokens": spec.max_new_tokens,
        }
        if spec.stop:
            params["stop"] = list(spec.stop)
        if spec.stop_token_ids:
            params["stop_token_ids"] = list(spec.stop_token_ids)
        if spec.deterministic:
            params["sampling_seed"] = sample_seed(self.spec.seed, rollout_id, index)
        return params

    async def generate(
        self, rollout_id: int, prompts: list[tuple[Prompt, list[int], list[int]]]
    ) -> tuple[RolloutBatch, dict[str, float]]:
        spec = self.spec.rollout
        started = time.monotonic()
        requests = []
        for prompt_number, (prompt, prompt_ids, _) in enumerate(prompts):
            for sample in range(spec.n_samples_per_prompt):
                params = self.sampling_params(rollout_id, prompt_number * spec.n_samples_per_prompt + sample)
                requests.append((prompt, prompt_ids, params))
        results = await asyncio.gather(*(self.router.generate(ids, params) for _, ids, params in requests))
        elapsed = time.monotonic() - started
        batch = self._to_batch(requests, results)
        lengths = batch.response_lengths.float()
        longest = max(results, key=lambda r: r["meta_info"]["completion_tokens"])
        rewards = batch.rewards
        metrics = {
            "rollout/reward_mean": rewards.mean().item(),
            "rollout/reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
            "rollout/response_length_mean": lengths.mean().item(),
            "rollout/response_length_max": lengths.max().item(),
            "rollout/time": elapsed,
            "perf/generated_tokens_per_sec": lengths.sum().item() / elapsed,
            "perf/longest_sample_tokens_per_sec": longest["meta_info"]["completion_tokens"]
            / max(longest["meta_info"]["e2e_latency"], 1e-9),
        }
        return batch, metrics

    def _to_batch(self, requests, results) -> RolloutBatch:
        rows = [ids + r["output_ids"] for (_, ids, _), r in zip(requests, results)]
        width = max(len(row) for row in rows)
        tokens = torch.full((len(rows), width), pad_token_id(self.tokenizer), dtype=torch.long)
        engine_logprobs = torch.zeros(len(rows), width)
        rewards, versions = [], []
        for i, ((prompt, ids, _), result) in enumerate(zip(requests, results)):
            tokens[i, : len(rows[i])] = torch.tensor(rows[i])
            logprobs = [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]
            engine_logprobs[i, len(ids) : len(ids) + len(logprobs)] = torch.tensor(logprobs)
            response = self.tokenizer.decode(result["output_ids"], skip_special_tokens=True)
            rewards.append(float(self.reward(prompt.text, response, prompt.label)))
            versions.append(int(result["meta_info"]["weight_version"]))
        return RolloutBatch(
            tokens=tokens,
            prompt_lengths=torch.tensor([len(ids) for _, ids, _ in requests]),
            response_lengths=torch.tensor([len(r["output_ids"]) for r in results]),
            engine_logprobs=engine_logprobs,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            prompt_indices=torch.tensor([p.index for p, _, _ in requests]),
            prompt_epochs=torch.tensor([p.epoch for p, _, _ in requests]),
            weight_versions=torch.tensor(versions),
        )

    def supervised_batch(
        self, prompts: list[tuple[Prompt, list[int], list[int]]]
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """SFT: each prompt followed by its label as the response; nothing is generated or scored."""
        started = time.monotonic()
        rows = [ids + response for _, ids, response in prompts]
        width = max(len(row) for row in rows)
        tokens = torch.full((len(rows), width), pad_token_id(self.tokenizer), dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row)
        prompt_lengths = torch.tensor([len(ids) for _, ids, _ in prompts])
        response_lengths = torch.tensor([len(row) for row in rows]) - prompt_lengths
        batch = RolloutBatch(
            tokens=tokens,
            prompt_lengths=prompt_lengths,
            response_lengths=response_lengths,
            engine_logprobs=torch.zeros(len(rows), width),
            rewards=torch.zeros(len(rows)),
            prompt_indices=torch.tensor([p.index for p, _, _ in prompts]),
            prompt_epochs=torch.tensor([p.epoch for p, _, _ in prompts]),
            weight_versions=torch.full((len(rows),), self.engine_version or 0),
        )
        lengths = response_lengths.float()
        metrics = {
            "rollout/response_length_mean": lengths.mean().item(),
            "rollout/response_length_max": lengths.max().item(),
            "rollout/time": time.monotonic() - started,
        }
        return batch, metrics

    # --- the loop ---------------------------------------------------------------

    def resume_point(self) -> int:
        """Restore the data source from the newest committed rollout; return the next id."""
        done = jobenv.committed_rollouts(self.workdir)
        if not done:
            return 0
        _, meta = read_rollout(self.workdir, done[-1])
        self.data.load_state_dict(meta["data_state"])
        return done[-1] + 1

    def recorded_point(self) -> int:
        """The first rollout without a line in metrics.jsonl; a partial last line (a crash mid-append) is dropped."""
        path = self.workdir / "metrics.jsonl"
        if not path.exists():
            return 0
        raw = path.read_bytes()
        whole = raw[: raw.rfind(b"\n") + 1]
        if whole != raw:
            write_file_atomic(path, whole)
        lines = whole.splitlines()
        return orjson.loads(lines[-1])["rollout"] + 1 if lines else 0

    async def record_trained(self, rollout_id: int) -> None:
        """Once the trainer has applied ``rollout_id``, log its metrics line and progress."""
        # Written after the weights it reports on; those may already be pruned.
        metrics_file = jobenv.train_metrics_path(self.workdir, rollout_id)
        while not metrics_file.is_file():
            await asyncio.sleep(POLL_INTERVAL_S)
        _, meta = read_rollout(self.workdir, rollout_id)
        line = {"rollout": rollout_id, "time": time.time(), **meta["metrics"], **orjson.loads(metrics_file.read_bytes())}
        if rollout_id in self.commit_times:
            line["rollout/commit_time"] = self.commit_times.pop(rollout_id)
        with open(self.workdir / "metrics.jsonl", "ab") as handle:
            handle.write(orjson.dumps(line) + b"\n")
        for sink in self.sinks:
            sink.write(line)
        await self.progress.report(rollout_id, line)

    async def run(self) -> None:
        spec = self.spec.rollout
        start = self.resume_point()
        recorded = self.recorded_point()
        await self.wait_for_engines()
        for rollout_id in range(start, spec.num_rollouts):
            load_time = await self.serve_version(generating_version(rollout_id, spec.mode))
            # In async mode this records rollout N - 1, trained while N was generated.
            while recorded < rollout_id and jobenv.train_metrics_path(self.workdir, recorded).is_file():
                await self.record_trained(recorded)
                recorded += 1
            prompts, skipped = self.draw()
            if skipped:
                await self.progress.event(
                    "prompts_skipped",
                    f"{len(skipped)} prompt(s) longer than {self.spec.prompt_limit} tokens (or, for SFT, with a "
                    f"response over {spec.max_new_tokens}) skipped",
                    rollout=rollout_id,
                    prompts=[[p.index, p.epoch] for p in skipped],
                )
            if self.spec.algorithm.kind is AlgorithmKind.SFT:
                batch, metrics = self.supervised_batch(prompts)
            else:
                batch, metrics = await self.generate(rollout_id, prompts)
            metrics["rollout/weight_version"] = float(self.engine_version)
            metrics["rollout/skipped_prompts"] = float(len(skipped))
            metrics["rollout/weights_load_time"] = load_time
            commit_started = time.monotonic()
            meta = {
                "data_state": self.data.state_dict(),
                "metrics": metrics,
                "skipped_prompts": [[p.index, p.epoch] for p in skipped],
                # Which orchestrator wrote it: the chaos checker proves one writer per rollout with it.
                "writer": {
                    "node": os.environ.get(jobenv.NODE),
                    "generation": self.assignment.generation if self.assignment else None,
                    "pid": os.getpid(),
                },
            }
            if self.assignment is not None:
                await self.assignment.exit_if_superseded(self.progress.store)
            write_rollout(self.workdir, rollout_id, batch, meta)
            commit_time = time.monotonic() - commit_started
            # Kept beside the rollout's metrics; known only once the commit is done.
            self.commit_times[rollout_id] = commit_time
            log.info("rollout %d committed: %d samples", rollout_id, batch.size)
        for rollout_id in range(recorded, spec.num_rollouts):
            await self.record_trained(rollout_id)
        for sink in self.sinks:
            sink.close()
        await self.progress.finish()


async def amain() -> None:
    env = jobenv.JobEnv.from_environ()
    # Patient: while erld replaces engines or the router, generation waits rather than fails.
    router = RouterClient(os.environ[jobenv.ROUTER_URL], attempts=ROUTER_ATTEMPTS)
    endpoint = os.environ.get(jobenv.ETCD)
    assignment = Assignment.from_environ() if endpoint else None
    async with ProgressReporter.connect(env.job, endpoint, env.workdir) as progress:
        await Orchestrator(env, router, progress, assignment).run()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(amain())


if __name__ == "__main__":
    main()
