"""Pure decisions, no I/O: observed state in, actions out (restart backoff, health verdicts, NaN response, placement)."""
