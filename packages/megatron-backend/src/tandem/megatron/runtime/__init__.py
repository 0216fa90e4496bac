"""What a train worker's process and the driver's processes share: fault points, GPU memory figures, and the
checkpoint folder's crash-safe protocol.

`fault_points` (named points where a test kills the process), `gpu_memory` (a
process's and its GPU's memory as nvidia-smi reports it, the CUDA allocator's
calls), `checkpoint_folder` (a model's checkpoint folders, their markers, the
save protocol around any writer, a full disk) and `checkpoint_manifest` (each
file's size and checksum, recorded at a save and verified before a load). The
lowest layer of tandem.megatron, imported by the worker and by tandem-ppo-driver's
driver, engines and reward model alike: it may import the standard library, torch
only inside the allocator's counter and xxhash inside the manifest's checksum;
never Megatron, transformers, Ray or another tandem module (tests/test_import_graph.py).
"""
