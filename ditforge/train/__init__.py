"""Training loop, checkpoints and run logging."""
