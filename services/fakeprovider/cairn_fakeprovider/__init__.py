"""The offline demo model: an OpenAI-compatible chat-completions server that can misbehave.

It answers deterministically from the data the orchestrator fences into the prompt,
so the demo runs without a model vendor, and tests script it to fail the way real
vendors fail (429, 5xx, hangs, cut streams, broken JSON) over real HTTP.
"""
