"""Fine-tuning: the training loop, its losses, the optimizer and schedule, guards and metrics.

The losses are token-normalised, with balancing; the guards cover routing, memory and NaN; the metrics are those
the loop logs.
"""
