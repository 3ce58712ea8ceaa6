"""The OpenAI-compatible HTTP server (`nanovllm serve`): FastAPI front end, engine in a child
process. Start-up in launch.py, routes in app.py."""
