"""Reading a local JSON endpoint (``/health``, ``/link``) without raising: for waits and status."""

import json
import urllib.error
import urllib.request


def get_json(url: str, timeout_s: float = 2.0):
    """The JSON body at ``url``, error answers' (e.g. a 503 ``/health``) included; None when
    nothing answers or the body is not JSON."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            return json.loads(exc.read())
        except ValueError:
            return None
    except (OSError, ValueError):
        return None


def http_ok(url: str) -> bool:
    """Whether ``url`` answers with JSON."""
    return get_json(url) is not None
