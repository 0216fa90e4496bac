"""A run on disk and on the terminal: its folder, lock, checkpoints, state, events, metrics, trackers and logs."""
