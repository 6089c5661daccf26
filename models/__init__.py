"""Flax NNX transformer layers naming logical axes only (import as `meshrun_models`)."""
