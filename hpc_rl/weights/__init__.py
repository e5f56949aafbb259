"""Trainer <-> engine weights: HF name mapping, export, bucketed broadcast, the weight-update group.

The group name below is a wire constant the controller also sends; it lives here, torch-free,
so the controller can name the group without importing torch."""

DEFAULT_GROUP_NAME = "weight_update_group"
