"""The expert-coverage validation set: constraints, the greedy multi-cover, the stage and its heatmap.

The constraints are per (layer, expert); the stage is the one that writes the set and its heatmap.
"""
