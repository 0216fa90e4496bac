"""The `ppo-driver` command and its subcommands: train, demo, eval, export, plot, fetch-model.

`cli` (the command), `dry_run` (`--dry-run`), `machine` (a CPU run's settings),
`evaluate` (`eval`, `export`), `plot` and `pretrained` (`fetch-model`); beside them,
at the package's top, the demos' tasks `_demo`, `_sums` and `_tiny` (where run
configs name them: `tandem.ppo._demo:digit_reward`). The top layer: it may import
every other; the loop, torch and Ray only once a command runs, so that `--help`
loads none of them (tests/test_import_graph.py, tests/ppo/test_cli_help.py).
"""
