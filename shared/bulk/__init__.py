"""The bulk KV channel: authenticated framed TCP carrying KV frames, one flow per request and
receiver, striped over one or more pooled connections (``path_sizing`` says how many).

Paths: ``local`` (prefill → relay decode, same site; stands in for RDMA) and ``wan``
(prefill → main decode, through the WAN link). KV never goes through NATS.
"""
