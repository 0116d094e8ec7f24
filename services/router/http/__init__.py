"""The OpenAI-compatible HTTP front end of the router."""
