"""rtrl: shared infrastructure (settings, local services, Kafka and ClickHouse access, CLI)."""

__version__ = "0.1.0"
