"""posenc PyTorch reference: config, tokenizer, positional variants, transformer, data, training, checkpoints.

Importing the package imports no torch; the tokenizer and config stay usable without it.
"""
