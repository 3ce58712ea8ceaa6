"""The engine: requests in, outputs out (LLMEngine, LLM), and the server's engine process."""
