"""Fine-tuning: the training loop, its losses, the optimizer and schedule, guards and metrics.

Fine-tuning: the training loop, its token-normalised losses and balancing, the optimizer and schedule,
the routing, memory and NaN guards, and the metrics it logs.
"""
