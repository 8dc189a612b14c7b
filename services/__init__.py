"""Services: one package per actor process (router, prefill, relay_decode, main_decode, cache_index)."""
