"""Viewers of the collector's published view: the client, the Textual dashboard, the
browser view. They read the view model only."""
