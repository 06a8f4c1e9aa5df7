"""Command-line entry points of mtds."""
