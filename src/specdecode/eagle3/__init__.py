"""EAGLE-3 draft heads: the model (`head`), its files (`checkpoint`) and its training (`train`)."""

from specdecode.eagle3.checkpoint import load_head, save_head
from specdecode.eagle3.head import Eagle3Config, Eagle3Head

__all__ = ["Eagle3Config", "Eagle3Head", "load_head", "save_head"]
