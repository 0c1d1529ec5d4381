"""`dlm-studio web`: the Gradio studio (chat, compare, traces), a pure consumer of runs' events.

A local studio never phones home: gradio's usage analytics are off before gradio is imported.
"""
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
