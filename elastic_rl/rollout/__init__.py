"""The orchestrator's side: data source, rewards, generation and the rollout batches it hands the trainers."""
