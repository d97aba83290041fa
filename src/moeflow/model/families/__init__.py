"""Model families moeflow adds to transformers: Step-3.5-Flash, DeepSeek-V3 with MTP, their registration.

Model families moeflow adds to transformers: Step-3.5-Flash's causal LM on transformers 5's decoder
(``step3p5``), DeepSeek-V3 with its MTP layers (``deepseek_v3``), the MTP layers they carry (``mtp``), and their
registration with the auto classes (``registry``).
"""
