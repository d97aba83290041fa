"""Training state on disk: resumable checkpoints, the safetensors files, the final model's export.

Every rank writes its own pieces of a resumable checkpoint through torch.distributed.checkpoint; the safetensors
files are those the checkpoints and the exports use.
"""
