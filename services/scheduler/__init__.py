"""Global scheduler service: routes each request to a worker (docs/design.md section 5)."""
