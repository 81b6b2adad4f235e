"""The HTTP server: OpenAI- and Anthropic-compatible endpoints, a web chat page and a live monitor.

`strata serve` (strata/cli/serve.py) builds the app with `create_app` (strata/serve/app.py) and runs it with
uvicorn. The pieces: `schemas` (request validation), `scheduler` (queue, sequence slots, cancellation), `cache`
(conversation reuse), `tools` (thinking and tool-call parsing), `metrics` (counters, /v1/status, /metrics),
`openai_api` and `anthropic_api` (the two wire formats). See docs/serve.md.
"""
