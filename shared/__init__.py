"""Flywheel's common package: message schemas, topics, Kafka helpers, config, telemetry, embedded broker."""
