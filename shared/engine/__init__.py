"""The engines that prefill, relay-decode and main-decode instances run.

``backend`` is the one interface services use (``EngineBackend``, its views, the registry
behind ``--engine``). ``hf_engine`` is the transformers backend, built like nano-vllm:
``scheduler``, ``model_runner``, ``sampler`` and ``stop_detector``, over ``block_manager``,
``prefix_cache`` and ``kv_pool``, with ``kv_transfer`` for wire frames and ``attention`` for
paged attention inside HF models.
"""
