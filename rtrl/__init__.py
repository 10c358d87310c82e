"""rtrl foundation: settings, errors, Kafka and ClickHouse access (imports only ``schemas``)."""

__version__ = "0.1.0"
