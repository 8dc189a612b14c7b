"""The block-KV engine that prefill, relay-decode and main-decode instances all run.

Modules: ``engine`` (scheduling and forward passes), ``kv_pool`` (tensor storage),
``block_manager`` and ``prefix_cache`` (ownership and reuse of blocks), ``attention``
(paged attention inside HF models), ``sampling``, ``sequence``, ``kv_layout``.
"""
