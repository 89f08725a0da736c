"""Inference engines behind one HTTP contract (SGLang's), the router, and their clients."""
