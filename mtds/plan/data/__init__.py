"""Reference tables shipped with the planner (published numbers, each file cites its source)."""
