"""Capture: a module, loss and optimizer -> one named aten graph of the whole training step."""
from .capture import FORWARD, LOSS_AND_GRADS, TRAIN, Captured, capture

__all__ = ["FORWARD", "LOSS_AND_GRADS", "TRAIN", "Captured", "capture"]
