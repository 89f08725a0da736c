"""The job spec: what a user writes to describe an elastic-rl job.

A spec is YAML, validated by pydantic models: one module per section (``model``, ``data``,
``rollout``, ``engines``, ``trainer``, ``algorithm``, ``checkpoints``, ``fault_tolerance``,
``metrics``, ``eval``, ``debug``), each holding its model, a docstring per field and its own
checks; ``job`` composes them into ``JobSpec`` with the checks that cross sections; ``loading``
reads a file, applies ``--set`` overrides and reports every problem with its field path. Every
model forbids unknown keys and is frozen once loaded. Nothing here imports torch.
"""
