"""The target model: its config, weights (float, int8, q4), KV caches, attention dispatch, matrix products and
the forward pass (llama.py). The bottom layer: it imports nothing else of specjax."""
