"""The OpenAI-compatible HTTP server (`nanovllm serve`): FastAPI front end, engine in a child
process. Start-up in launch.py, the front-end processes in front_ends.py, routes in app.py."""
