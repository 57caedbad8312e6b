"""Object storage behind checkpoints: which URLs accel takes, and moving files to and from them.

Every path a checkpoint function takes may be a URL of an fsspec store (`s3://` through s3fs,
`gs://` through gcsfs, `memory://`); a plain path (or `file://`) stays a local folder and keeps
the local code. `urls` refuses what accel cannot honour (an unknown protocol, a missing package)
and `transfer` uploads and downloads whole files, concurrently, checked against the sizes and
crc32 checksums of accel's manifest; each request is sent again while its failure may pass
(`retries`). `exports` moves model exports; `staging` holds the local folders in between.

Private to accel: shared by checkpoint/ and big_model/.
"""
