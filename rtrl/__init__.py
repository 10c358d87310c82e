"""rtrl foundation: settings, errors, Kafka and ClickHouse access.

It imports only ``schemas``. Every component's settings section is in :mod:`rtrl.sections`.
"""

__version__ = "0.1.0"
