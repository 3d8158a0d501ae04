"""Drafter training (the DFlash, DSpark and DFlash2 recipes): `train(TrainConfig(...))` or `blockspec train`."""

from blockspec.train.config import TrainConfig, add_train_args
from blockspec.train.run import main, train

__all__ = ["TrainConfig", "add_train_args", "main", "train"]
