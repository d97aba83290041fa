"""What only the Snakefile needs: config loading and checks, recipe advice, stage keys, rule code, the report card.

The config is loaded and merged; the stage settings and keys name cached outputs; the rule code gives each rule's
library inputs; the report card is the one a finished run prints.
"""
