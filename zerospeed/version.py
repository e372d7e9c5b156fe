__version__ = "0.1.0"
__version_major__, __version_minor__, __version_patch__ = (int(p) for p in __version__.split("."))
__git_hash__ = None
__git_branch__ = None
