"""The application: CLI, the closed loop, its parts and supervisor, reports, A/B runs (imports anything below)."""
