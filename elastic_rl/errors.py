"""The errors elastic-rl raises to a user, each with a message they can act on."""

from __future__ import annotations


class ElasticRLError(Exception):
    """Base of every error meant for a user rather than a traceback."""


class SpecError(ElasticRLError):
    """A job spec is invalid. Holds one line per problem, each naming its field or file."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class InputError(ElasticRLError):
    """A command was given something it cannot use (a missing file, a taken name); exit code 2."""


class RolloutLogError(InputError):
    """A rollout log this version cannot read: another version of elastic-rl wrote it."""


class EngineError(ElasticRLError):
    """An inference engine or the router answered with an error or not at all."""


class EngineRejected(EngineError):
    """An engine refused a request as invalid (HTTP 4xx): sending it again cannot help."""


class GaveUp(ElasticRLError):
    """A failure budget of the rollout side ran out: the job fails, with this as its reason."""


class WrongDevice(ElasticRLError):
    """A process was given a device it cannot compute on here (a GPU slot, and a torch built without
    CUDA): a restart on the same slot fails the same way."""
