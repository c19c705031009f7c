"""Capacity simulation without a model: workloads, the paged replay through the real
scheduler, contiguous-reservation baselines, and KV budgets from model configs.

Nothing here imports torch (``pagedkv simulate`` runs where no model does).
"""
