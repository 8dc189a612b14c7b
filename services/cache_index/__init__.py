"""Cache index: consumes KV events of every P and MD instance and answers prefix-overlap queries.

Not implemented yet (issue: two sites, five services).
"""
