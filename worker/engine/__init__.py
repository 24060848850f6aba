"""The engine: `Engine.step()` = schedule (scheduler, block_manager, sequence) -> run
(model_runner, attention_metadata, cuda_graphs, sampler) -> postprocess; AsyncEngine runs one
engine loop for every concurrent request. Its public API is engine.py and config.py."""
