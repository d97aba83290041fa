"""Model families moeflow adds to transformers: Step-3.5-Flash, DeepSeek-V3 with MTP, their registration.

The modules: ``step3p5`` (Step-3.5-Flash's causal LM on transformers 5's decoder), ``deepseek_v3`` (DeepSeek-V3
with its MTP layers), ``mtp`` (the MTP layers they carry) and ``registry`` (their registration with the auto
classes).
"""
