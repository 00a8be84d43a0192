"""OpenAI-compatible front end: protocol, server, output parsers (tool calls, reasoning)."""
