"""The edge: an OpenAI-compatible HTTP API in front of the mesh."""
