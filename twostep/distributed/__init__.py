"""Tensor parallelism on torch.distributed: a rank's place in the group and the collectives the
decoder needs (parallel.py)."""
