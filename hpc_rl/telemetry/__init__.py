"""Logging set-up, TensorBoard scalars and the one-line progress report."""
