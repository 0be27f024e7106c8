"""Bundled output processors: pass an instance as ``output_processor=``."""

from ..postprocess import DefaultProcessor

__all__ = ["DefaultProcessor"]
