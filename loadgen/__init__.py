"""Workloads, arrival processes, the HTTP benchmark client and the demo."""
