"""What a run keeps on disk and reads back: checkpoints, the workdir and its lock, fingerprints,
tensor files, the per-user cache, TensorBoard events, and the checks on files from others
(folders, safetensors headers).

Imports ``errors``, ``sharding.paths`` and ``multihost``."""
