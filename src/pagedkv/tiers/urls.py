"""Connection URLs as they may be shown: never with their password.

A Redis URL carries its credentials (``redis://user:secret@host:6379/0``); every log line and
error message that names the server uses :func:`redact_url`, which keeps the scheme, user, host,
port and path and replaces the password with ``***``.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redact_url(url: str) -> str:
    """``url`` with its password (and any query parameter named ``password``) replaced by
    ``***``; a string that does not parse as a URL is replaced whole when it holds an ``@``."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            creds, _, host = netloc.rpartition("@")
            user, sep, _ = creds.partition(":")
            # redis://secret@host: a lone field may be a password (some clients read it so)
            netloc = f"{user}:***@{host}" if sep else f"***@{host}"
        query = "&".join(
            f"{k}=***" if k.lower() == "password" else f"{k}{eq}{v}"
            for k, eq, v in (q.partition("=") for q in parts.query.split("&") if q)
        )
        if netloc == parts.netloc and query == parts.query:
            return url  # nothing secret (urlunsplit would also turn unix:/// into unix:/)
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return "<redacted url>" if "@" in url else url
