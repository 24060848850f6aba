"""`detgate worker`'s OpenAI-compatible HTTP server. A request flows one way:
app (routes, errors) -> the endpoint's module (completions, score, status, admin) -> generation
(engine sequences to choices) -> the engine's public API."""
