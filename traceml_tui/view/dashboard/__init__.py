"""The Textual dashboard: the view side. It reads RunViews (viewmodel.py); the data side
never imports it."""

from .app import DashboardApp

__all__ = ["DashboardApp"]
