"""PPO's critic in the trainer's step, started by test_ppo_critic.py.

    python -m tests.integration.ppo_worker OUT_FILE POLICY_CHECKPOINT CRITIC_CHECKPOINT
    (RANK, WORLD_SIZE, MASTER_* set)

Builds the tiny policy and its critic at TP=1 and trains them with PPO under a quorum of one replica
(``tests.trainer_doubles.FakeSoloQuorum``) on the same rollout ten times over, its rewards a fixed
function of the sample: records the value loss and explained variance of each, the trained critic's
values from packed and from padded micro-batches, and what a NaN in the critic's head did to the step.
Then builds a policy from POLICY_CHECKPOINT with its critic from CRITIC_CHECKPOINT
(``algorithm.critic.hf_checkpoint``) and records what the critic started from.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import torch

from elastic_rl.model.gpt import destroy_model_parallel, init_model_parallel
from elastic_rl.model.source import ModelSource
from elastic_rl.spec.loading import load_spec, validate_spec
from elastic_rl.spec.model import ModelSpec
from elastic_rl.trainer.critic import Critic
from elastic_rl.trainer.grpo import GrpoTrainer, NonFiniteStep
from elastic_rl.trainer.lr_schedule import lr_lambda
from elastic_rl.trainer.optimizer import build_optimizer
from tests.integration.micro_batch_worker import SAMPLES, varied_batch
from tests.processes import SPEC
from tests.trainer_doubles import FakeSoloQuorum

ROLLOUTS = 10
COMMON = [
    "algorithm.advantage_estimator=ppo",
    "rollout.n_samples_per_prompt=4",
    "rollout.prompts_per_rollout=3",
    f"trainer.global_batch_size={SAMPLES}",
    "trainer.max_tokens_per_micro_batch=120",
    "trainer.lr_decay=constant",
]


def ppo_trainer(overrides: list[str]) -> tuple[GrpoTrainer, ModelSource]:
    spec = load_spec(SPEC, [*COMMON, *overrides])
    source = ModelSource.from_spec(spec.model)
    with torch.random.fork_rng(devices=[]):  # every trainer starts from the same weights
        model = source.build_policy()
        critic = Critic(spec, source.build_critic(model, None), total_steps=100)
    optimizer = build_optimizer(model, spec.trainer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec.trainer, 100))
    return GrpoTrainer(spec, model, optimizer, scheduler, FakeSoloQuorum(), 0, critic=critic), source


def critic_from_a_checkpoint(policy_checkpoint: Path, critic_checkpoint: Path) -> dict[str, bool]:
    """A critic started from another checkpoint than its policy's: its body is that checkpoint's, its
    head zero."""
    spec = validate_spec(
        {
            "name": "critic-from-a-checkpoint",
            "model": {"hf_checkpoint": str(policy_checkpoint)},
            "algorithm": {"advantage_estimator": "ppo", "critic": {"hf_checkpoint": str(critic_checkpoint)}},
        }
    )
    source = ModelSource.from_spec(spec.model)
    policy = source.build_policy()
    critic = source.build_critic(policy, spec.algorithm.critic.hf_checkpoint).state_dict()
    started = policy.state_dict()
    imported = ModelSource.from_spec(ModelSpec(hf_checkpoint=critic_checkpoint)).build_policy().state_dict()
    # Tensors only: megatron's state dicts also hold its layers' extra state (None here).
    body = {
        name: value for name, value in critic.items() if torch.is_tensor(value) and not name.startswith("value_head.")
    }
    return {
        "body_is_its_checkpoint": body.keys() == {name for name, value in imported.items() if torch.is_tensor(value)}
        and all(torch.equal(tensor, imported[name]) for name, tensor in body.items()),
        "body_is_not_the_policy": any(not torch.equal(tensor, started[name]) for name, tensor in body.items()),
        "head_is_zero": all(critic[f"value_head.{name}"].abs().sum() == 0 for name in ("weight", "bias")),
    }


def main() -> None:
    out = Path(sys.argv[1])
    torch.use_deterministic_algorithms(True)
    init_model_parallel(1, seed=7)
    trainer, source = ppo_trainer([])
    batch = varied_batch(len(source.tokenizer))
    batch.rewards = (batch.tokens[:, 0] % 2).float()  # the first token decides: a value seen from every token
    results: dict = {"value_loss": [], "explained_variance": []}
    for rollout_id in range(ROLLOUTS):
        context = trainer.prepare(rollout_id, batch)
        assert trainer.step(context, 0).committed
        metrics = trainer.rollout_metrics(context)
        results["value_loss"].append(metrics["train/value_loss"])
        results["explained_variance"].append(metrics["train/explained_variance"])

    # The trained critic's values, through packed and through padded micro-batches.
    values = []
    for packing in ("true", "false"):
        reader, _ = ppo_trainer([f"trainer.packing={packing}"])
        reader.critic.model.load_state_dict(trainer.critic.model.state_dict())
        micro_batches = reader._micro_batches(batch, torch.arange(batch.size))
        values.append(reader.critic.values(micro_batches, batch.tokens.shape, reader.device))
    results["packed_padded_values_gap"] = ((values[0] - values[1]).abs() * batch.loss_mask).max().item()
    results["max_value"] = (values[1].abs() * batch.loss_mask).max().item()

    head = trainer.critic.model.value_head
    with torch.no_grad():
        head.bias.fill_(float("nan"))
    before = [p.detach().clone() for p in [*trainer.model.parameters(), head.weight]]
    context = trainer.prepare(ROLLOUTS, batch)
    try:
        trainer.step(context, 0)
        results["nan_step"] = "committed"
    except NonFiniteStep as refused:
        results["nan_step"] = str(refused)
    after = [*trainer.model.parameters(), head.weight]
    results["nan_step_left_weights"] = all(torch.equal(a, b) for a, b in zip(before, after))
    results["from_a_checkpoint"] = critic_from_a_checkpoint(Path(sys.argv[2]), Path(sys.argv[3]))
    out.write_bytes(orjson.dumps(results))
    destroy_model_parallel()


if __name__ == "__main__":
    main()
