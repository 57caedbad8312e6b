"""Store errors: which may pass if the request is sent again, and the one line the others (and
those that did not pass) become.

A request that fails for a reason that may pass (a dropped connection, a timeout, the store's
"slow down" or 5xx) is tried again after 0.25 s, 0.5 s, 1 s, 2 s (on top of the retries the
store's client makes itself: botocore's AWS_MAX_ATTEMPTS); what still fails, or fails for a
reason that will not pass (a missing bucket, a denied request), is raised as one line naming
the URL and the store's error, never the credentials.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from types import MappingProxyType
from typing import TypeVar

from accel._safetensors.header import CorruptFileError

T = TypeVar("T")

ATTEMPTS = 5
FIRST_DELAY_S = 0.25
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EAGAIN, errno.EBUSY, errno.ECONNABORTED, errno.ECONNREFUSED, errno.ECONNRESET,
        errno.EPIPE, errno.ETIMEDOUT, getattr(errno, "EREMOTEIO", errno.EIO),
    }
)  # fmt: skip
# Transient errors of the clients under fsspec's stores, by class name: importing botocore or
# aiohttp here would import them for every store.
_TRANSIENT_NAMES = frozenset(
    {
        "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
        "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError",
        "ClientConnectionError", "ClientPayloadError", "ServerDisconnectedError",
        "ServerTimeoutError", "FSTimeoutError", "HTTPClientError",
    }
)  # fmt: skip


def is_transient(err: BaseException) -> bool:
    """True for a store error that may pass if the request is sent again."""
    if isinstance(err, (FileNotFoundError, PermissionError, FileExistsError, CorruptFileError)):
        return False
    if isinstance(err, (TimeoutError, ConnectionError)):
        return True
    if isinstance(err, OSError) and err.errno in _TRANSIENT_ERRNOS:
        return True
    return bool({c.__name__ for c in type(err).__mro__} & _TRANSIENT_NAMES)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


_MAKE_BUCKET = MappingProxyType(
    {
        "gs": "`gcloud storage buckets create gs://<bucket>`",
        "gcs": "`gcloud storage buckets create gs://<bucket>`",
    }
)


def no_bucket(err: BaseException) -> bool:
    """True for the store's error (or accel's) saying the URL's bucket does not exist."""
    text = str(err).lower()
    said = ("specified bucket does not exist", "nosuchbucket", "the bucket of")
    return isinstance(err, FileNotFoundError) and any(words in text for words in said)


def store_error(fn: str, url: str, err: BaseException, *, attempts: int = 1) -> Exception:
    """The one-line error of `fn` for the store's `err` on `url` (after `attempts` tries)."""
    said = _one_line(err)
    if isinstance(err, PermissionError):
        return PermissionError(
            errno.EACCES,
            f"{fn}: the store denied a request on {url!r} ({said}); check the credentials its "
            "client reads (for s3://: AWS_PROFILE or AWS_ACCESS_KEY_ID, ~/.aws; for gs://: "
            "GOOGLE_APPLICATION_CREDENTIALS or gcloud's login) and the bucket's policy",
        )
    if no_bucket(err):
        return FileNotFoundError(
            errno.ENOENT,
            f"{fn}: the bucket of {url!r} does not exist ({said}); create it first (e.g. "
            f"{_MAKE_BUCKET.get(url.split('://')[0], '`aws s3 mb s3://<bucket>`')}) or fix the URL",
        )
    if isinstance(err, (FileNotFoundError, CorruptFileError)):
        return err
    code = err.errno if isinstance(err, OSError) and err.errno else errno.EIO
    tried = f" after {attempts} attempts" if attempts > 1 else ""
    return OSError(
        code,
        f"{fn}: {url!r} failed{tried}: {said}; check the network and the store's endpoint "
        "(AWS_ENDPOINT_URL for an S3-compatible server), then try again",
    )


def retried(fn: str, url: str, call: Callable[[], T]) -> T:
    """`call()`, sent again after a transient failure; raises `store_error` once it gives up."""
    delay = FIRST_DELAY_S
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return call()
        except Exception as err:
            if not is_transient(err) or attempt == ATTEMPTS:
                raise store_error(fn, url, err, attempts=attempt) from err
        time.sleep(delay)
        delay *= 2
    raise AssertionError("unreachable")
