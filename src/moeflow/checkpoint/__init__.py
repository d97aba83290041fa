"""Training state on disk: resumable checkpoints, the safetensors files, the final model's export.

Training state on disk: resumable checkpoints (every rank writes its own pieces through
torch.distributed.checkpoint), the safetensors files they and the exports use, and the final model's export.
"""
