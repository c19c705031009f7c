"""Sampling: ``SamplingParams`` (what a request asks for) and the batched torch ``Sampler``."""
