"""elastic-rl's GRPO loss against TRL's GRPOTrainer (pinned in the test extra) on identical inputs: the
same completions and rewards (TRL's trainer is handed them through its `rollout_func`), the same old and
new log probabilities (from one small transformers model, with the old ones moved off the new so that
clipping engages). With matching settings the two agree term by term: the advantages (group
normalisation, with TRL's epsilon), the loss mask, and each step's loss and gradient (the clipping, and
the aggregation with its denominator: TRL's `dapo` default is `rollout_token_mean`, its `bnpo` is
`token_mean`, its `grpo` is `seq_mean_token_mean`)."""

from __future__ import annotations

import os

import pytest
import torch

from elastic_rl.algo.advantages import token_advantages
from elastic_rl.algo.losses import aggregate, loss_tokens
from elastic_rl.algo.objective import token_losses
from elastic_rl.model.tokenizer import as_transformers, build_tokenizer
from elastic_rl.spec.algorithm import AdvantageEstimator, AlgorithmSpec, LossAggregation

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL; it is how inputs get in
trl = pytest.importorskip("trl", reason="TRL is in the test extra: pip install -e '.[test]'")
from datasets import Dataset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from trl.trainer.utils import split_tensor_dict  # noqa: E402

GROUP = 4
PROMPTS = ["1=", "2="]
STEPS = 2  # two optimizer steps of one group each
TRL_EPSILON = 1e-4


@pytest.fixture(scope="module")
def tokenizer():
    return as_transformers(build_tokenizer())


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).train()


def completions(tokenizer) -> list[list[int]]:
    """Eight completions of different lengths, half ended by end-of-sequence (kept in the loss)."""
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    return [
        [digits[i]] * (1 + i % 3) + ([tokenizer.eos_token_id] if i % 2 else []) for i in range(len(PROMPTS) * GROUP)
    ]


REWARDS = [0.0, 1.0, 2.0, 0.0, 1.0, 1.0, 0.0, 0.5]


def trl_trainer(model, tokenizer, tmp_path, loss_type: str, scale_rewards: str):
    made = completions(tokenizer)
    by_completion = {tuple(ids): reward for ids, reward in zip(made, REWARDS)}

    def rollout_func(prompts, trainer):
        prompt_ids = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
        return {"prompt_ids": prompt_ids, "completion_ids": made, "logprobs": [[0.0] * len(ids) for ids in made]}

    def reward(prompts, completions, completion_ids, **kwargs):
        return [by_completion[tuple(ids)] for ids in completion_ids]

    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,  # TRL autocasts to bf16 by default, on a CPU too; elastic-rl computes the loss in fp32
        per_device_train_batch_size=GROUP,
        num_generations=GROUP,
        steps_per_generation=STEPS,
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        loss_type=loss_type,
        scale_rewards=scale_rewards,
        max_completion_length=8,
        report_to=[],
    )
    dataset = Dataset.from_list([{"prompt": prompt} for prompt in PROMPTS])
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )
    trainer.current_gradient_accumulation_steps = 1  # what transformers' training loop sets before a step
    return trainer


def completion_log_probs(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """Each completion token's log prob under ``model``, [batch, completion tokens]."""
    tokens = torch.cat([prompt_ids, completion_ids], dim=1)
    logits = model(input_ids=tokens, attention_mask=torch.cat([prompt_mask, completion_mask], dim=1)).logits
    logits = logits[:, prompt_ids.shape[1] - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def gradients(model) -> list[torch.Tensor]:
    return [param.grad.clone() for param in model.parameters()]


@pytest.mark.parametrize(
    ("loss_type", "aggregation"),
    [
        ("dapo", LossAggregation.ROLLOUT_TOKEN_MEAN),
        ("bnpo", LossAggregation.TOKEN_MEAN),
        ("grpo", LossAggregation.SEQ_MEAN_TOKEN_MEAN),
    ],
)
@pytest.mark.parametrize(("scale_rewards", "by_std"), [("group", True), ("none", False)])
def test_the_loss_and_gradient_equal_trls_term_by_term(
    model, tokenizer, tmp_path, loss_type, aggregation, scale_rewards, by_std
):
    trainer = trl_trainer(model, tokenizer, tmp_path, loss_type, scale_rewards)
    generated = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(GROUP)])
    algorithm = AlgorithmSpec(
        loss_aggregation=aggregation, normalize_advantages_by_std=by_std, advantage_std_epsilon=TRL_EPSILON
    )

    # The loss mask: every completion token, end-of-sequence included, nothing after.
    mask = torch.zeros_like(generated["completion_mask"], dtype=torch.float32)
    for row, ids in enumerate(completions(tokenizer)):
        mask[row, : len(ids)] = 1.0
    assert torch.equal(generated["completion_mask"].float(), mask)

    # The advantages: each reward against its group.
    advantages = token_advantages(
        AdvantageEstimator.GRPO,
        torch.tensor(REWARDS),
        mask,
        GROUP,
        by_std,
        std_epsilon=algorithm.advantage_std_epsilon,
    )
    assert torch.allclose(advantages[:, 0], generated["advantages"], atol=1e-6, rtol=0)

    # The old log probs are the model's before the rollout's first step, in both.
    inputs = [generated[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    with torch.no_grad():
        now = completion_log_probs(model, *inputs)
    assert torch.allclose(generated["old_per_token_logps"] * mask, now * mask, atol=1e-6)
    # Moved off the current policy, so that some tokens' ratios leave the clip range both ways.
    old = now + 0.4 * torch.randn(now.shape, generator=torch.Generator().manual_seed(1))

    rollout_tokens = int(mask.sum())
    for step, batch in enumerate(split_tensor_dict(generated, STEPS)):
        rows = slice(step * GROUP, (step + 1) * GROUP)
        batch["old_per_token_logps"] = old[rows]
        model.zero_grad()
        theirs = trainer._compute_loss(model, batch)
        theirs.backward()
        their_gradients = gradients(model)

        model.zero_grad()
        logp = completion_log_probs(model, *(tensor[rows] for tensor in inputs))
        terms = token_losses(
            algorithm, logp, torch.zeros_like(logp), old[rows], old[rows], None, advantages[rows], mask[rows]
        )
        assert terms.clipped[mask[rows] > 0].any()  # the clip is exercised
        tokens = loss_tokens(aggregation, int(mask[rows].sum()), rollout_tokens, STEPS)
        ours = aggregate(terms.loss, mask[rows], aggregation, tokens, GROUP)
        ours.backward()

        assert torch.allclose(ours, theirs, atol=1e-7, rtol=1e-5), (step, ours.item(), theirs.item())
        for mine, their in zip(gradients(model), their_gradients):
            assert torch.allclose(mine, their, atol=1e-7, rtol=1e-4)
