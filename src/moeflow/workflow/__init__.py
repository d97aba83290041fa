"""What only the Snakefile needs: config loading and checks, recipe advice, stage keys, rule code.

What only the Snakefile needs: loading and merging the config, its checks, the advice for a copied
recipe, the stage settings and keys that name cached outputs, and each rule's library inputs.
"""
