"""An optimizer outside meshrun: `optimizer.name=custom_optimizer.sgd:SGD` (docs/optimizers.md)."""
