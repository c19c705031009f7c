"""The engine: requests in, outputs out.

``LLMEngine`` (llm_engine.py) drives one step at a time — the Rust scheduler picks the batch,
the worker runs it, the sampler draws tokens, the scheduler applies them, the detokenizer turns
them into text. Along the way: input_processor.py checks and builds a new request,
admission.py adds it to the scheduler (blocked while it waits for a grammar or remote KV),
forward.py runs a step's forward, output_processor.py turns a step's updates into outputs,
failures.py fails requests alone, stats.py keeps the counters and cost models, startup.py
builds the parts. ``LLM`` (llm.py) and ``AsyncLLM`` (async_llm.py) are its offline and asyncio
front ends; ``EngineArgs`` (args.py) is their one configuration. Nothing here is imported by
``import pagedkv``: the engine needs torch and transformers.
"""
