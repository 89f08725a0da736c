"""elastic-rl: RL post-training of language models that keeps going when hardware fails."""
