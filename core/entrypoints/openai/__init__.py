"""OpenAI-compatible HTTP server (``core serve``): FastAPI app, handlers, metrics."""
