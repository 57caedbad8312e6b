"""A checkpoint location: a local folder (a Path) or a URL of an fsspec store (a `Remote`).

A string with `://` is a URL and never a local path: `s3://bucket/run` taken as a folder would
be a folder named `s3:` in the working directory, gone with the machine. Its protocol must be
one fsspec knows, with its package installed (imported only now, when a URL needs it); else
the call is refused in one line naming the package and accel's extra that installs it.
`file://` URLs are local paths. Credentials come from the store's own environment and config
(AWS_PROFILE, AWS_ENDPOINT_URL, fsspec's config files and FSSPEC_<PROTOCOL>_<KEY> variables);
a URL's own user:password, if it has one, is never shown in a message.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

# The protocols whose package accel names an extra for: protocol -> (package, extra).
EXTRAS = MappingProxyType(
    {
        "s3": ("s3fs", "s3"),
        "s3a": ("s3fs", "s3"),
        "gs": ("gcsfs", "gcs"),
        "gcs": ("gcsfs", "gcs"),
    }
)
_LOCAL = frozenset({"file", "local"})
_SCHEME = re.compile(r"(?P<protocol>[A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True, slots=True, kw_only=True)
class Remote:
    """A folder (a key prefix) of an object store, reached through fsspec."""

    url: str
    """The URL as accel names it in messages (no trailing slash, credentials hidden)."""
    protocol: str
    """The URL's protocol, as written ("s3", "gs", "memory", ...)."""
    fs: Any
    """The fsspec filesystem that serves it (the store's own client and config)."""
    path: str
    """The folder's path as `fs` takes it ("bucket/run")."""

    def child(self, rel: str) -> Remote:
        """The location `rel` (a posix path) below this one."""
        return Remote(
            url=f"{self.url}/{rel}", protocol=self.protocol, fs=self.fs, path=f"{self.path}/{rel}"
        )

    def key(self, rel: str) -> str:
        """`fs`'s path of the file `rel` below this folder."""
        return f"{self.path}/{rel}"

    def url_of(self, rel: str) -> str:
        """The URL of the file `rel` below this folder, for messages."""
        return f"{self.url}/{rel}"

    @property
    def name(self) -> str:
        """The last part of the path, as `Path.name` gives it."""
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> Remote:
        """The folder holding this one."""
        head, _, _ = self.path.rpartition("/")
        url_head, _, _ = self.url.rpartition("/")
        return Remote(url=url_head, protocol=self.protocol, fs=self.fs, path=head)

    def __str__(self) -> str:
        return self.url


Location = Path | Remote


def hidden(url: str) -> str:
    """`url` with any user:password and query string hidden, for messages."""
    return re.sub(r"\?.*$", "?***", re.sub(r"://[^/@]*@", "://***@", url))


def locate(fn: str, name: str, value: object) -> Location:
    """`value` (a path or URL argument of `fn` called `name`) as a local Path or a `Remote`.

    Raises:
        TypeError: `value` is neither a str nor an os.PathLike.
        ValueError: a URL of a protocol fsspec does not know, a chained URL, or a Path whose
            first part is a known protocol (`Path("s3://b")` collapses to `s3:/b`).
        ImportError: the package of the URL's protocol is not installed (naming the extra).
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{fn}: {name}={value!r} must be a folder path or URL (str or os.PathLike); pass "
            f"where the files go, e.g. {name}='checkpoints' or {name}='s3://bucket/run'."
        )
    if isinstance(value, str) and ("://" in value or "::" in value):
        match = _SCHEME.match(value)
        if match is None or "::" in value:
            raise ValueError(
                f"{fn}: {name}={hidden(value)!r} is not a URL accel takes; expected "
                "'<protocol>://<path>' (chained fsspec URLs are not supported). Pass one "
                "store's URL, or a local path."
            )
        protocol = match["protocol"].lower()
        if protocol in _LOCAL:
            return Path(value[match.end() :] or "/")
        return _remote(fn, name, value.rstrip("/"), protocol)
    path = Path(value)
    first = path.parts[0] if path.parts else ""
    if not path.is_absolute() and first.endswith(":") and _is_protocol(first[:-1].lower()):
        raise ValueError(
            f"{fn}: {name}={str(path)!r} looks like a URL that pathlib collapsed ('//' became "
            f"'/'); a local folder named {first!r} is almost never meant. Pass the URL as a "
            f"str: {name}='{first}//{'/'.join(path.parts[1:])}'."
        )
    return path


def _is_protocol(protocol: str) -> bool:
    from fsspec.registry import known_implementations, registry

    return protocol in known_implementations or protocol in registry


def _remote(fn: str, name: str, url: str, protocol: str) -> Remote:
    import fsspec  # on use: only a URL needs it (a dependency of torch, always installed)

    shown = hidden(url)
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ValueError(
            f"{fn}: {name}={shown!r} has the protocol {protocol!r}, which fsspec does not "
            "know; accel takes local paths and fsspec URLs (s3://, gs://, memory://, ...). "
            "Install the fsspec package for it, or pass a local path."
        ) from None
    except ImportError:
        package, extra = EXTRAS.get(protocol, ("fsspec's package for it", ""))
        how = f"pip install 'accel-train[{extra}]' (or {package})" if extra else package
        raise ImportError(
            f"{fn}: {name}={shown!r} needs {package} for {protocol}:// URLs, which is not "
            f"installed; install it: {how}."
        ) from None
    fs, path = fsspec.core.url_to_fs(url)
    return Remote(url=shown, protocol=protocol, fs=fs, path=path.rstrip("/"))


def display(location: Location) -> str:
    """How a message names `location`."""
    return str(location)
