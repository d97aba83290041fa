"""What only the Snakefile needs: config loading and checks, recipe advice, stage keys, rule code, the report card.

What only the Snakefile needs: loading and merging the config, its checks, the advice for a copied
recipe, the stage settings and keys that name cached outputs, each rule's library inputs, and the report card
a finished run prints.
"""
