"""Global scheduler service: routes each request to a worker (DESIGN.md s.5)."""
