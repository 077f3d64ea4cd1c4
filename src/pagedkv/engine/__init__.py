"""The reference engine: paged KV tensors, attention, Llama-family models, sampler and LLM API.

This is the only package of pagedkv that imports torch.
"""
