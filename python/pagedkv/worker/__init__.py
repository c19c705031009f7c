"""The worker: a transformers model on the paged KV cache, one packed forward per step.

``ModelRunner`` (model_runner.py) loads the model (model_files.py finds it, model_support.py
refuses what it cannot serve), owns the KV tensor, and routes every attention layer through
pagedkv's registered attention function (attention_backend.py) into :mod:`pagedkv.kernels`.
"""
