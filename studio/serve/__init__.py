"""The studio as an OpenAI-compatible server (docs/serving.md): `protocol` (the wire format), `scheduler` (the decode
thread and its queue), `app` (the FastAPI routes)."""
