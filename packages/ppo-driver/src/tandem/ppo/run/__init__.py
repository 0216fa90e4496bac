"""A run on disk and on the terminal: its folder, lock, checkpoints, state, events, metrics, trackers and logs.

`folder` (`RunFolder`: locked, where it resumes, changed only once the run is up),
`lock`, `checkpoint` (a checkpoint of the whole run, and where a start resumes),
`state` (the driver's state beside each checkpoint), `log` (events.jsonl, the
phase clock, the summary), `metrics` (metrics.jsonl, TensorBoard, the progress
bar), `trackers` (wandb, MLflow), `worker_logs` (RUN_DIR/logs), `terminal`, `errors`
(how a failing command ends), `export` (the actor as a Hugging Face folder) and `health`
(why a run may not be learning, judged from its steps' figures: pure). It
may import the config, the rollout layer and the engines, tandem.megatron's
`runtime` and `group`; never the loop or the command (tests/test_import_graph.py).
"""
