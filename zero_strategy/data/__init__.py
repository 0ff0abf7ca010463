"""LightningDataModules that need no download: byte-level text (the standard library's source by
default, or any file or folder), generated sets, and a byte-window classification set."""

from .byte_corpus import VOCAB_SIZE, ByteWindows, StdlibDataModule, TextDataModule
from .corrupted_source import CorruptedSourceDataModule
from .synthetic import GaussianClassificationDataModule, MarkovLMDataModule

__all__ = ["VOCAB_SIZE", "ByteWindows", "CorruptedSourceDataModule", "GaussianClassificationDataModule",
           "MarkovLMDataModule", "StdlibDataModule", "TextDataModule"]
