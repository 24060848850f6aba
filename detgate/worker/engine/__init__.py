"""The engine: `Engine.step()` = schedule (scheduler, block_manager, sequence) -> run
(model_runner, cuda_graphs, sampler) -> postprocess; AsyncEngine runs one engine loop for every
concurrent request and applies weight updates between steps (async_engine.py). Its public API
is engine.py, async_engine.py and config.py; the attention metadata it builds
is the model's input type (model/attention_metadata.py)."""
