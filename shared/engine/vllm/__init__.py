"""The ``vllm`` backend: vLLM's engine, in this process, behind ``EngineBackend``.

KV crosses between vLLM's cache and PDD's wire frames through ``PddConnector``, a vLLM KV
connector loaded by module path; vLLM's block events become PDD's stored/evicted hashes. vLLM
itself is imported only when a backend is built (``make setup-vllm`` installs it in its own
virtual environment).
"""
