"""Output-length prediction service (request/reply over NATS, queue group)."""
