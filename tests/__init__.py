"""elastic-rl's tests: unit (pure), integration (real processes on CPU), and gpu-marked ones."""
