"""Trainer for MoE language models with jtopoep balancing: `python -m train --config ...`."""
