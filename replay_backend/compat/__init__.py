"""Private torch APIs, one module per concern, each feature-detected (torch >= 2.11)."""
