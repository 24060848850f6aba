"""The determinism gateway: routes OpenAI-style calls, records them in Redis, replays them.

Never imports torch or triton.
"""
