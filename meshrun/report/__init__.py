"""What meshrun reports about a train step: `explain` (compile it, never run it), `profile` (trace a few
steps) and `startup` (the block a run prints before compiling). Above `meshrun.train`: these build,
compile or run the step. Importing this package imports no jax."""
