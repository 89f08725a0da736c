"""PPO's pieces against values worked out by hand: GAE over a critic's values, the whitening of its
advantages, the clipped value loss, the explained variance, the critic's schedule, and the spec's rules
for the critic."""

from __future__ import annotations

import pytest
import torch

from elastic_rl.algo.advantages import explained_variance, gae, whiten
from elastic_rl.algo.losses import clipped_value_loss
from elastic_rl.errors import SpecError
from elastic_rl.spec.loading import validate_spec
from elastic_rl.trainer.lr_schedule import lr_lambda
from tests.unit.test_config import hf_checkpoint

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

PPO = {"advantage_estimator": "ppo", "critic": {}}


def test_gae_discounts_td_errors_back_from_the_reward_at_the_last_token():
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])  # a prompt token, then three response tokens
    values = torch.tensor([[7.0, 0.5, 0.2, 0.4]])
    result = gae(torch.tensor([1.0]), values, mask, gamma=0.9, lam=0.8)
    # t=3: 1 - 0.4 = 0.6; t=2: 0.9*0.4 - 0.2 + 0.72*0.6 = 0.592; t=1: 0.9*0.2 - 0.5 + 0.72*0.592 = 0.10624.
    raw = torch.tensor([[0.0, 0.10624, 0.592, 0.6]])
    assert torch.allclose(result.returns, (raw + values) * mask, atol=1e-6)
    assert torch.allclose(result.advantages, whiten(raw, mask), atol=1e-6)


def test_gae_at_gamma_and_lambda_one_is_the_return_less_the_value_and_skips_unmasked_tokens():
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])  # row 0: a tool's token between two of its own
    values = torch.tensor([[0.3, 9.0, 0.1], [0.25, 0.5, 0.0]])
    result = gae(torch.tensor([1.0, 0.0]), values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(result.returns, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), atol=1e-6)
    raw = torch.tensor([[0.7, 0.0, 0.9], [-0.25, -0.5, 0.0]])
    assert torch.allclose(result.advantages, whiten(raw, mask), atol=1e-6)


def test_gae_pays_a_kl_penalty_at_each_token():
    mask = torch.ones(1, 2)
    kl = torch.tensor([[0.5, 1.0]])
    result = gae(torch.tensor([1.0]), torch.zeros(1, 2), mask, gamma=1.0, lam=1.0, token_kl=kl, kl_coef=0.1)
    # Token 1: 1 - 0.1; token 0: -0.05 + 0.9.
    assert torch.allclose(result.returns, torch.tensor([[0.85, 0.9]]), atol=1e-6)


def test_whitening_divides_by_the_sample_standard_deviation_of_the_masked_tokens():
    values = torch.tensor([[1.0, 2.0, 50.0], [3.0, -7.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # 1, 2, 3: mean 2, sample variance (1 + 0 + 1) / 2 = 1 (slime's Bessel-corrected whitening).
    expected = torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert torch.allclose(whiten(values, mask), expected, atol=1e-6)
    assert whiten(torch.tensor([[4.0, 4.0]]), torch.ones(1, 2)).abs().sum() == 0  # no spread: no signal


def test_the_value_loss_takes_the_larger_of_the_clipped_and_free_errors():
    values, old, returns = torch.tensor([1.0, 0.1, -1.0]), torch.zeros(3), torch.tensor([2.0, 2.0, 0.0])
    loss, clipped = clipped_value_loss(values, old, returns, clip=0.2)
    # 1.0 is held to 0.2: (0.2 - 2)^2 = 3.24 beats (1 - 2)^2 = 1. 0.1 is inside the clip. -1.0 is held to -0.2,
    # whose error 0.04 is the smaller: the free one, 1, is taken.
    assert torch.allclose(loss, torch.tensor([1.62, 0.5 * 1.9**2, 0.5]), atol=1e-6)
    assert clipped.tolist() == [1.0, 0.0, 0.0]


def test_explained_variance():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    returns = torch.tensor([[1.0, 3.0, 0.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.zeros(1, 3), returns, mask) == pytest.approx(0.0)
    assert explained_variance(torch.tensor([[2.0, 2.0, 5.0]]), returns, mask) == pytest.approx(0.0)
    assert explained_variance(torch.tensor([[3.0, 1.0, 0.0]]), returns, mask) == pytest.approx(-3.0)


def test_ppo_has_a_critic_and_only_ppo_has_one():
    assert validate_spec({"name": "j", "algorithm": {"advantage_estimator": "ppo"}}).algorithm.critic.value_clip == 0.2
    with pytest.raises(SpecError, match="advantage_estimator ppo"):
        validate_spec({"name": "j", "algorithm": {"critic": {}}})
    spec = validate_spec({"name": "j", "algorithm": {**PPO, "critic": {"lr": 1e-5, "warmup_rollouts": 2}}})
    assert spec.algorithm.critic.warmup_rollouts == 2


@pytest.mark.parametrize(
    "trainer, named",
    [
        ({"tensor_parallel": 2, "sequence_parallel": True}, "trainer.sequence_parallel false"),
        ({"context_parallel": 2}, "trainer.context_parallel 1"),
        ({"dtype": "bf16-params"}, "trainer.dtype fp32 or bf16"),
    ],
)
def test_a_critic_is_refused_where_it_is_not_built(trainer, named):
    with pytest.raises(SpecError, match=named):
        validate_spec({"name": "j", "algorithm": PPO, "trainer": trainer})


def test_the_critic_has_its_own_peak_and_warmup_on_the_policys_decay():
    trainer = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2, "lr_decay": "linear"}
    critic = {"lr": 5e-4, "lr_warmup_steps": 4}
    spec = validate_spec({"name": "j", "trainer": trainer, "algorithm": {**PPO, "critic": critic}})
    settings = spec.algorithm.critic.as_trainer(spec.trainer)
    assert (settings.lr, settings.warmup_steps, settings.min_lr) == (5e-4, 4, 1e-4)
    policy, value = lr_lambda(spec.trainer, 20), lr_lambda(settings, 20)
    assert [policy(0), value(0), value(3)] == [0.5, 0.25, 1.0]
    assert value(20) * settings.lr == pytest.approx(1e-4)  # both decay to trainer.min_lr
    unset = validate_spec({"name": "j", "trainer": trainer, "algorithm": PPO}).algorithm.critic.as_trainer(spec.trainer)
    assert unset == spec.trainer
    with pytest.raises(SpecError, match="algorithm.critic.lr 5e-05 is below trainer.min_lr 0.0001"):
        validate_spec({"name": "j", "trainer": trainer, "algorithm": {**PPO, "critic": {"lr": 5e-5}}})


def test_a_critic_is_refused_for_expert_parallelism_and_a_mixture_of_experts(tmp_path):
    moe = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}
    mixture = {"hf_checkpoint": str(hf_checkpoint(tmp_path / "moe", **moe))}
    layout = {"data_parallel": 2, "expert_parallel": 2, "shard_optimizer": False}
    with pytest.raises(SpecError, match="trainer.expert_parallel 1"):
        validate_spec({"name": "j", "model": mixture, "trainer": layout, "algorithm": PPO})
    with pytest.raises(SpecError, match="algorithm.critic is built for dense models"):
        validate_spec({"name": "j", "model": mixture, "algorithm": PPO})


def test_a_critic_checkpoint_must_have_the_policys_architecture(tmp_path):
    policy = {"hf_checkpoint": str(hf_checkpoint(tmp_path / "policy"))}
    same = str(hf_checkpoint(tmp_path / "same"))
    spec = validate_spec({"name": "j", "model": policy, "algorithm": {**PPO, "critic": {"hf_checkpoint": same}}})
    assert str(spec.algorithm.critic.hf_checkpoint) == same
    wider = str(hf_checkpoint(tmp_path / "wider", hidden_size=128))
    with pytest.raises(SpecError, match="its architecture differs from model.hf_checkpoint's"):
        validate_spec({"name": "j", "model": policy, "algorithm": {**PPO, "critic": {"hf_checkpoint": wider}}})
    with pytest.raises(SpecError, match="a critic checkpoint needs a policy from model.hf_checkpoint"):
        validate_spec({"name": "j", "algorithm": {**PPO, "critic": {"hf_checkpoint": same}}})
