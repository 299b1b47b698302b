"""Code every prefixmesh service uses: wire messages, subjects, config, bus, lifecycle."""
