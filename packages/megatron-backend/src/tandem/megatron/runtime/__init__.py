"""Mechanisms that the train worker's process and the driver's processes share: fault points, GPU memory
figures, and the checkpoint folder's crash-safe protocol."""
