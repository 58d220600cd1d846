"""megapar.launch: launchers (local processes, torchrun, Ray), the CLI, the demo and benchmarks."""


import megapar as _megapar

_megapar.alias_short_name(__name__)  # `import launch` is `megapar.launch` (see megapar/__init__.py)
from .local import RankError, launch_local

__all__ = ["launch_local", "RankError", "launch_on_ray", "init_from_env"]


def __getattr__(name: str):
    if name == "launch_on_ray":
        from .ray_launcher import launch_on_ray

        return launch_on_ray
    if name == "init_from_env":
        from .env import init_from_env

        return init_from_env
    raise AttributeError(name)
