"""Router: the OpenAI-compatible HTTP front door; tokenizes, asks cache-index, picks instances and the pipeline.

Not implemented yet (issue: two sites, five services).
"""
