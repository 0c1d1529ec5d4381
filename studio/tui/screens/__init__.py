"""The studio's screens: chat (the first), compare, replay, and the help overlay."""
