"""The RL objective as pure tensor functions: advantages, policy losses, KL estimators."""
