"""The Textual studio (`dlm-studio tui`, `dlm-studio chat` on a terminal): chat, compare and replay screens
over one token grid, metrics panel and inspector. Imported only by the commands that open it (textual is
a heavy import). Screens drive runs through `studio.run.worker.Worker` and render `studio.viz` models; they
never touch a strategy or the model."""
