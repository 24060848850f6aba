"""HTTP routes: inference (OpenAI endpoints), score, records and replays, operations."""
