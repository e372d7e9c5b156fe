"""Version strings. `__version__` is the DeepSpeed API level implemented, with zerospeed's own
release as a PEP 440 local label: client libraries compare it with DeepSpeed versions
(">=0.16.0"), and the label tells a person (or `packaging`) that it is zerospeed."""

DEEPSPEED_API_VERSION = "0.19.8"
__zerospeed_version__ = "0.1.0"
__version__ = f"{DEEPSPEED_API_VERSION}+zerospeed.{__zerospeed_version__}"
__version_major__, __version_minor__, __version_patch__ = (int(p) for p in DEEPSPEED_API_VERSION.split("."))
__git_hash__ = None
__git_branch__ = None
