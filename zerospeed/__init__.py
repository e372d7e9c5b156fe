"""zerospeed: DeepSpeed's interface, a lean runtime. `import zerospeed as deepspeed` and go."""

from zerospeed.version import __version__, __version_major__, __version_minor__, __version_patch__

__all__ = ["__version__", "__version_major__", "__version_minor__", "__version_patch__"]
