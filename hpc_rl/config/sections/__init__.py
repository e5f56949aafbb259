"""The sections of the run config (`hpc_rl.config.schema.RunConfig`), one module per group of sections.

Each field's docstring (the string literal after it) is its `--help` text.
"""
