"""The OpenAI-compatible protocol, once: request parsing and validation, choice fan-out,
response and stream shapes, and the HTTP error handling. Served by the edge and by a
standalone worker (``prefixmesh worker --http``)."""
