"""Load generation and benchmarks: the engine microbenchmark now; the agentic trace and `pdd bench` later."""
