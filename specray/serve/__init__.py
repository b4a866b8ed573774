"""The OpenAI-compatible HTTP server over ``AsyncLLM`` (``specray serve``); see docs/serving.md."""
