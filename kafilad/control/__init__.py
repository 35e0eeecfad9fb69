"""control package (see the layout in STYLE.md)."""
