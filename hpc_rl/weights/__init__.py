"""Trainer <-> engine weights: HF name mapping, export, bucketed broadcast (`bucket_layout`: the byte layout
both the trainer and the engines read), the weight-update group. Engines import from here, never the reverse.

The group name below is a wire constant the controller also sends; it lives here, torch-free,
so the controller can name the group without importing torch."""

DEFAULT_GROUP_NAME = "weight_update_group"
