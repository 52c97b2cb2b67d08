"""Sequence parallelism across rank actors: process groups, yunchang USP attention, sharding.

Imports neither ``deployments`` nor ``pipeline``.
"""
