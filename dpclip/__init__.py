"""dpclip: differentially private deep learning with modern clipping methods."""

__version__ = "0.1.0"
