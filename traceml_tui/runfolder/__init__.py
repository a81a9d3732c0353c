"""The run folder: private folders and atomic files, and the per-step log."""
