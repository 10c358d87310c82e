"""Dev-only local services: the noida-db Kafka broker wrapper and the embedded ClickHouse HTTP front.

Used by tests, benchmarks and the embedded defaults of the application (``app.services``); no
production code path (foundation, data plane) imports this package.
"""
