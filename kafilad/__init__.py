"""Kafila daemon: serve one LLM across a trusted group's machines (see DESIGN.md)."""

__version__ = "0.1.0"
