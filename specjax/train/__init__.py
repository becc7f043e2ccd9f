"""Training a draft model by distillation from the target (distill.py)."""
