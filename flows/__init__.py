"""Bytewax dataflows of rtrl (reward flow, batch flow) and their Kafka wiring."""
