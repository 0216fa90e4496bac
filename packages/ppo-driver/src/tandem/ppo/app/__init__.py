"""The `ppo-driver` command and its subcommands: train, demo, eval, export, plot, fetch-model."""
