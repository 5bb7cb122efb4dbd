"""How a caller's string appears in logs and status details."""


def shown(text: str, limit: int = 48) -> str:
    """A caller's string as logs and status details show it: escaped, and cut to `limit`, so
    that no reply or log line repeats a caller's megabytes or forges a line."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"
