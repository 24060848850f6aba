"""HTTP routes: inference (OpenAI endpoints), records and replays, operations."""
