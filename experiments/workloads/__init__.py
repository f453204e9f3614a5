"""Attention in context: the train-step workload (a Flax LM with jax_attn / CP attention, Orbax
checkpoints) and JAX -> PyTorch parity bundles.

Entry points for run.py: `train_step.run_from_flags(FLAGS)` for --workload=train_step and
`parity.run_from_flags(FLAGS)` for --parity_bundle; their flags live in `flags.py`. Importing
this package imports nothing heavy: the torch side of a parity bundle (`parity`) never needs jax.
"""
