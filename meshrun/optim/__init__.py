"""Optimizers: `registry` (plain Python, what the planner reads) and `optimizer` (the optax code)."""
