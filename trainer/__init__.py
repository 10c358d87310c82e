"""Megatron-Core trainer: streamed micro-batches, Dr. GRPO + KL loss, checkpoints with consumed offsets."""
