"""Tool calling: parsers for the formats models write calls in, and the tool descriptions they read."""
