"""Cluster metrics assembled from the bus: Prometheus exposition and a JSON view."""
