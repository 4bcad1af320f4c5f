"""Metrics (Prometheus), tracing (OpenTelemetry) and trace ids in log lines, for every service."""
