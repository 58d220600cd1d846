"""megapar.parallel: process groups and the communication primitives built on them."""


import megapar as _megapar

_megapar.alias_short_name(__name__)  # `import parallel` is `megapar.parallel` (see megapar/__init__.py)
from .config import ParallelConfig
from .groups import Group, ParallelGroups, destroy_parallel, get_groups, get_optional_groups, init_parallel

__all__ = ["ParallelConfig", "Group", "ParallelGroups", "init_parallel", "destroy_parallel", "get_groups",
           "get_optional_groups"]
