"""Stand-in for compose-rl's reward modeling package."""
