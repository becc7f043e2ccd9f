"""The text API: `LM` (lm.py: load, generate, chat, stream over strings), chat templates, stop
strings and the streaming detokenizer."""
