"""Data: sources, the tokenizer, packing, the Arrow shards, the training order, rows to model inputs.

Data: reading the sources, the tokenizer, packing documents into rows, the Arrow shards and their
manifest, the validation set's format, the order training reads rows in, and rows to model inputs.
"""
