"""``infinite-llm bench``: a load generator that measures a running router or REST gateway the way
``vllm bench serve`` measures a server (throughput, TTFT, TPOT, ITL, end-to-end latency).

``datasets`` builds the requests, ``targets`` sends one (gRPC or HTTP + SSE), ``runner`` shapes the load
(Poisson arrivals, concurrency, a deadline), ``metrics`` turns timestamps into numbers (pure), ``report``
prints them and ``command`` holds the flags.
"""
