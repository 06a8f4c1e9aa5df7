"""The planner's predictions checked against real runs on this machine and against held-out published rows."""
