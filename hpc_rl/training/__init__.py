"""Trainer side: losses and advantages (pure torch), micro-batch packing, and the Megatron trainer."""
