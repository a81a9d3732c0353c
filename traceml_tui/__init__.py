"""traceml-tui: live diagnosis of PyTorch distributed training.

The data side (collector, windows, diagnosis, summary, compare) never imports
the view side (the Textual dashboard).
"""

__version__ = "0.1.0"
