"""Tool calling: prompt rendering, the required/named-call grammar, and call parsers."""
