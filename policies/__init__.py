"""Pure decisions, no I/O: observed state in, actions out.

Restart backoff, health verdicts, the NaN response, placement.
"""
