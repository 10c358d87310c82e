"""rtrl foundation: settings, errors, Kafka and ClickHouse access.

It imports ``schemas`` and the settings sections in each package's ``config`` module, which load no component.
"""

__version__ = "0.1.0"
