"""Errors a user can act on: each message names the setting, address or table involved and the fix."""


class RtrlError(Exception):
    """Base class for errors rtrl reports to users (the CLI prints them without a traceback)."""


class ConfigError(RtrlError):
    """A setting is unknown or has a bad value; the message names the setting and the fix."""


class ServiceUnavailable(RtrlError):
    """Kafka or ClickHouse did not answer within the configured time; the message names the address."""


class SchemaMismatch(RtrlError):
    """A ClickHouse table or Kafka topic differs from what schemas/ defines."""
