"""Embedded tiny models: FLUX.1 architecture at a few MB, built locally from a fixed seed."""
