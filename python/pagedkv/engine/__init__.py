"""The engine: requests in, outputs out.

``LLMEngine`` (llm_engine.py) drives one step at a time — the Rust scheduler picks the batch,
the worker runs it, the sampler draws tokens, the scheduler applies them, the detokenizer turns
them into text. ``LLM`` (llm.py) and ``AsyncLLM`` (async_llm.py) are its offline and asyncio
front ends; ``EngineArgs`` (args.py) is their one configuration. Nothing here is imported by
``import pagedkv``: the engine needs torch and transformers.
"""
