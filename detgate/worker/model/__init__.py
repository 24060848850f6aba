"""The model: decoder layers (Qwen3, Qwen2 and Llama share one implementation, decoder.py;
ModelConfig records what differs between them), numeric ops by mode, the checkpoint loader
(Hugging Face folders and GGUF files) and live weight updates (weight_update.py), where a
model comes from, and the tokenizer."""
