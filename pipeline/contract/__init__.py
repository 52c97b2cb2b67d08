"""Contracts at the edges: what a request may contain, checked before anything is queued.

``limits`` (what the served model and the configuration allow), ``base`` (fields and checks
shared by every generation request, and the one error describer), ``images`` (OpenAI's
``POST /v1/images/generations``) and ``videos`` (OpenAI's ``POST /v1/videos`` jobs).
Torch-free: the Ingress imports these.
"""
