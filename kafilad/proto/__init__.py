"""proto package (see the layout in STYLE.md)."""
