"""Main decode (MD, site B): decode-side radix cache, imports KV over the WAN, absorbs handoffs by one extend pass.

Not implemented yet (issue: two sites, five services).
"""
