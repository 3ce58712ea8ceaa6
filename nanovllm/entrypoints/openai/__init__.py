"""The OpenAI-compatible HTTP server (`nanovllm serve`): FastAPI front end, engine in a child
process. See api_server.py."""
