"""The PPO math, pure torch: GAE, KL, the losses, advantages and their estimators, GSPO, entropy, reward shaping.

Small pure functions of tensors with their shapes in the docstrings. This layer
may import torch (and `torch.distributed` for reductions over a process group
passed in), `tandem.megatron.choices`, and its own modules; never Megatron,
transformers, Ray, the models, the worker or the driver side
(tests/test_import_graph.py). `tandem.megatron` re-exports the public names.
"""

__all__: list[str] = []
