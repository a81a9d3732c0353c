"""The collector process and what it serves: ingest of every rank's messages (directly or
through node relays, authenticated), the view server, deep traces, metrics."""
