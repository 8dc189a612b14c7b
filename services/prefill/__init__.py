"""Prefill (P, site A): computes prompt KV with its own prefix cache, samples the first token, streams KV on both paths.

Not implemented yet (issue: two sites, five services).
"""
