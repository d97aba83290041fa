"""Model families: what moeflow knows about each, in one module or folder per family, and one registry.

``family`` (the record a family fills in), ``config_fields`` (reading a config for the planner's shape), one module
per family (``qwen_moe``, ``mixtral``, ``granitemoe``, ``olmoe``, ``gpt_oss``; ``deepseek_v3`` and ``step3p5`` are
folders whose ``modeling`` adds the model classes moeflow gives transformers), ``mtp`` (the MTP layers those two
carry) and ``registry`` (every family by model type, and the auto-class registration).
"""
