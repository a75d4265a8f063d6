"""Serving building blocks: an asyncio front for the engine, OpenAI schemas, routing, servers."""
