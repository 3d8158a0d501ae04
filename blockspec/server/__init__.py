"""OpenAI-compatible HTTP server: `blockspec serve` (FastAPI + uvicorn)."""
