"""The larger command groups of `dlm-studio`, one module each (`models`, `bench`), registered by studio.cli; the
commands import what they run (torch, the engine) inside themselves, so `--help` and argument errors stay fast."""
