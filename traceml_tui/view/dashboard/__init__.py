"""The Textual dashboard: the view side. It reads ViewStates; the data side never imports it."""

from .app import DashboardApp

__all__ = ["DashboardApp"]
