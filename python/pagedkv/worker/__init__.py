"""The worker: a transformers model on the paged KV cache, one packed forward per step.

``ModelRunner`` (model_runner.py) takes a step by the contract of step_input.py (the scheduler's
``SchedulerOutput`` satisfies it as it is). It sets up in three stages: model_loader.py loads the
model (model_files.py finds it, model_support.py refuses what it cannot serve), kv_cache_plan.py
plans the KV cache, kv_cache_alloc.py allocates it. Every attention layer goes through pagedkv's
registered attention function (attention_backend.py) into :mod:`pagedkv.kernels`. Tensor
parallelism reaches the runner only through the ``ParallelRank`` protocol (parallel_rank.py):
this package never imports :mod:`pagedkv.parallel`.
"""
