"""Compatibility layers with other projects' APIs."""
