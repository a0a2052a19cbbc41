"""Helpers shared by the tests: small models, data, the docs runner and DDP scripts."""
