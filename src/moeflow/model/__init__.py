"""The model: the factory, the chunked loss, routing per family, parameter categories, LoRA, experts.

The model: one factory that builds or loads a causal LM for a layout, the chunked loss every model
computes, routing read per family, parameter categories, LoRA adapters and the experts implementation.
"""
