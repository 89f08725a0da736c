"""Durable job state: DCP snapshots, the rollout log, the commit protocol, retention and discovery."""
