"""The expert-coverage validation set: constraints, the greedy multi-cover, the stage and its heatmap.

The expert-coverage validation set: per-(layer, expert) constraints, the greedy multi-cover, the
stage that writes the set and its heatmap.
"""
