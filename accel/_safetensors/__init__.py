"""The on-disk format that checkpoint/ and big_model/ both read: safetensors headers, the files
of a checkpoint, accel's manifest of sizes and checksums, and the crc32 behind it.

Private to accel: a shared home, so neither package reaches into the other's private modules.
"""
