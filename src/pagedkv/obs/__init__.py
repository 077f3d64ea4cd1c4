"""Observability: Prometheus metrics built from stats snapshots."""
