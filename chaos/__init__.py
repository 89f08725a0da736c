"""The chaos harness: fault injectors, scenarios and the invariant checker."""
