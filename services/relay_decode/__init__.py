"""Relay decode (RLD, site A): decodes eager tokens from the local KV copy, hands token IDs over to main decode.

Not implemented yet (issue: two sites, five services).
"""
